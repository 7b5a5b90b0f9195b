"""POST /v1/chat/completions: the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..dependencies import ready_service, require_api_key
from ..engine import Admission, EngineService, Job
from ..errors import STREAMED_RESPONSES
from ..generation import merged, respond, sse_event
from ..schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                       ChatCompletionRequest, ChoiceLogprobs, DeltaMessage, TokenLogprob, TopLogprob,
                       Usage, new_id)

router = APIRouter(tags=["chat"], dependencies=[Depends(require_api_key)])


def token_logprobs(positions, token_ids, top: int) -> list[TokenLogprob]:
    """OpenAI chat logprobs from vLLM's per-position {token id: Logprob}."""
    entries = []
    for position, token_id in zip(positions or [], token_ids):
        chosen = position[token_id]
        ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 0)[:top]
        entries.append(TokenLogprob(
            token=chosen.decoded_token or "", logprob=max(chosen.logprob, -9999.0),
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=max(lp.logprob, -9999.0),
                                     bytes=list((lp.decoded_token or "").encode())) for lp in ranked]))
    return entries


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           service: EngineService = Depends(ready_service)):
    arrival = time.perf_counter()
    service.check_model(body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    top = body.top_logprobs or 0
    admission = service.admit(body.n, param="n")
    with admission.released_on_error():
        prompt_ids = await asyncio.to_thread(service.chat_prompt, messages)
        jobs = service.build_jobs([prompt_ids], body, new_id("chatcmpl"), prompt_param="messages",
                                  logprobs=top if body.logprobs else None, logprobs_param="top_logprobs")
    texts = [messages[-1]["content"] if service.config.log_prompts else None]
    return await respond(request, jobs, admission, body.stream,
                         lambda: stream_chat(service, body, jobs, arrival, texts, top, admission),
                         lambda: collect_chat(service, body, jobs, arrival, texts, top))


async def collect_chat(service: EngineService, body: ChatCompletionRequest, jobs: list[Job], arrival: float,
                       texts, top: int) -> ChatCompletion:
    text = [""] * body.n
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(body.n)]
    finish: list[str | None] = [None] * body.n
    generated = 0
    async for _, output in merged(service, jobs, arrival, texts):
        for choice in output.outputs:
            text[choice.index] += choice.text
            generated += len(choice.token_ids)
            if body.logprobs:
                logprobs[choice.index] += token_logprobs(choice.logprobs, choice.token_ids, top)
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    prompt_tokens = len(jobs[0].prompt_ids)
    return ChatCompletion(
        id=jobs[0].request_id.rsplit("-", 1)[0], model=service.model_name,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=text[i]), finish_reason=finish[i],
                            logprobs=ChoiceLogprobs(content=logprobs[i]) if body.logprobs else None)
                 for i in range(body.n)],
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated),
        context_extension=jobs[0].settings.canonical())


async def stream_chat(service: EngineService, body: ChatCompletionRequest, jobs: list[Job], arrival: float, texts,
                      top: int, admission: Admission) -> AsyncIterator[str]:
    chunk_id, created = jobs[0].request_id.rsplit("-", 1)[0], int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(ChatCompletionChunk(id=chunk_id, created=created, model=service.model_name, choices=choices,
                                             usage=usage).model_dump(exclude_none=True))

    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(body.n)])
        generated = 0
        async for _, output in merged(service, jobs, arrival, texts):
            for choice in output.outputs:
                generated += len(choice.token_ids)
                if not choice.text and not choice.finish_reason:
                    continue
                logprobs = (ChoiceLogprobs(content=token_logprobs(choice.logprobs, choice.token_ids, top))
                            if body.logprobs else None)
                yield chunk([ChatChunkChoice(index=choice.index, delta=DeltaMessage(content=choice.text or None),
                                             logprobs=logprobs, finish_reason=choice.finish_reason)])
        if body.stream_options and body.stream_options.include_usage:
            prompt_tokens = len(jobs[0].prompt_ids)
            yield chunk([], Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                                  total_tokens=prompt_tokens + generated))
    finally:
        admission.release()
