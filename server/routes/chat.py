"""POST /v1/chat/completions: the model's chat template, streamed or not."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..dependencies import ready_service, require_api_key
from ..engine import EngineService
from ..errors import STREAMED_RESPONSES
from ..schemas import ChatCompletion, ChatCompletionRequest
from ..serving import chat_generation, respond

router = APIRouter(tags=["chat"], dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           service: EngineService = Depends(ready_service)):
    arrival = time.perf_counter()
    service.check_model(body.model)
    admission = service.admit(body.n, param="n")
    with admission.released_on_error():
        generation = await chat_generation(service, body, arrival)
    return await respond(request, generation, admission)
