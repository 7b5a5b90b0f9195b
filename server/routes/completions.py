"""POST /v1/completions: text (or token-id) prompts, one or several, streamed or not.

``echo`` with ``logprobs`` returns the prompt tokens' log-probabilities too (the OpenAI way to
score a text; the evaluation uses it for loss)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from ..dependencies import ready_service, require_api_key
from ..engine import EngineService
from ..errors import STREAMED_RESPONSES
from ..schemas import Completion, CompletionRequest
from ..serving import completion_generation, respond

router = APIRouter(tags=["completions"], dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=Completion, responses=STREAMED_RESPONSES)
async def completions(body: CompletionRequest, request: Request, service: EngineService = Depends(ready_service)):
    arrival = time.perf_counter()
    service.check_model(body.model)
    prompts = body.prompts()
    admission = service.admit(len(prompts) * body.n, param="n" if body.n > 1 else "prompt")
    with admission.released_on_error():
        generation = await completion_generation(service, body, prompts, arrival)
    return await respond(request, generation, admission)
