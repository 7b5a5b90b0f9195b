"""POST /v1/completions: text (or token-id) prompts, one or several, streamed or not: vLLM's
completion serving with this server's bounds and context_extension.

``echo`` with ``logprobs`` returns the prompt tokens' log-probabilities too (the OpenAI way to
score a text; the evaluation uses it for loss)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest

from rope_plugins.server.checks import check_model
from rope_plugins.server.dependencies import ReadyService, ServerCapacity, require_api_key
from rope_plugins.server.errors import STREAMED_RESPONSES
from rope_plugins.server.relay import serve, vllm_request
from rope_plugins.server.schemas import Completion, CompletionRequest

router = APIRouter(tags=["completions"], dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=Completion, responses=STREAMED_RESPONSES)
async def completions(body: CompletionRequest, request: Request, service: ReadyService, capacity: ServerCapacity):
    check_model(body.model, service.model_name, service.model_path)
    prompts = len(body.prompts())
    return await serve(request, service, capacity, service.openai.completion.create_completion, body,
                       vllm_request(body, VllmCompletionRequest), prompts * body.n, "n" if body.n > 1 else "prompt")
