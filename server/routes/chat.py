"""POST /v1/chat/completions: vLLM's chat serving (templates with tools, tool calls, structured
outputs), streamed or not, with this server's bounds and context_extension."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest

from rope_plugins.server.checks import check_model
from rope_plugins.server.dependencies import ReadyService, ServerCapacity, require_api_key
from rope_plugins.server.errors import STREAMED_RESPONSES, bad_request
from rope_plugins.server.relay import serve, vllm_request
from rope_plugins.server.schemas import ChatCompletion, ChatCompletionRequest

router = APIRouter(tags=["chat"], dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request, service: ReadyService,
                           capacity: ServerCapacity):
    check_model(body.model, service.model_name, service.model_path)
    if unanswerable := body.unanswerable_tool_message():
        param, reason = unanswerable
        raise bad_request(f"{param}: {reason}", param=param)
    return await serve(request, service, capacity, service.openai.chat.create_chat_completion,
                       body, vllm_request(body, VllmChatRequest), body.n, "n")
