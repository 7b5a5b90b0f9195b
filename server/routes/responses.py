"""POST /v1/responses: the Responses API (text and function tools), streamed with its event
types or not: vLLM's Responses serving with this server's bounds and context_extension."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmResponsesRequest

from rope_plugins.server.checks import check_model
from rope_plugins.server.dependencies import ReadyService, ServerCapacity, require_api_key
from rope_plugins.server.errors import STREAMED_RESPONSES
from rope_plugins.server.relay import responses_events, serve, vllm_request
from rope_plugins.server.schemas import ResponsesRequest

router = APIRouter(tags=["responses"], dependencies=[Depends(require_api_key)])


@router.post("/v1/responses", responses=STREAMED_RESPONSES)
async def responses(body: ResponsesRequest, request: Request, service: ReadyService, capacity: ServerCapacity):
    check_model(body.model, service.model_name, service.model_path)
    return await serve(request, service, capacity, service.openai.responses.create_responses,
                       body, vllm_request(body, VllmResponsesRequest), 1, "input", to_events=responses_events)
