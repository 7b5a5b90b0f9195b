"""GET /v1/models: the served model, its served maximum context, its training length, rotary and KV cache."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from rope_plugins.server.dependencies import ReadyService, require_api_key
from rope_plugins.server.errors import ERROR_RESPONSES
from rope_plugins.server.schemas import KVCacheCard, ModelCard, ModelList, RotaryCard

router = APIRouter(tags=["models"], dependencies=[Depends(require_api_key)])


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(service: ReadyService) -> ModelList:
    rotary = service.rotary
    return ModelList(data=[ModelCard(
        id=service.model_name, created=service.created, root=service.model_path,
        max_model_len=service.config.max_model_len, train_length=service.train_length,
        rotary=RotaryCard(kind=rotary.kind, base=rotary.base, head_dim=rotary.head_dim,
                          attention_factor=rotary.attention_factor),
        kv_cache=KVCacheCard(dtype=service.config.kv_cache_dtype, tokens=service.kv_cache_tokens,
                             bytes_per_token=service.kv_cache_bytes_per_token),
        default_context_extension={**service.config.extension_defaults(), "auto_method": service.config.auto_method})])
