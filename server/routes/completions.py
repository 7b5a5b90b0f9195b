"""POST /v1/completions: text (or token-id) prompts, one or several, streamed or not.

``echo`` with ``logprobs`` returns the prompt tokens' log-probabilities too (the OpenAI way to
score a text; the evaluation uses it for loss)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from ..dependencies import ready_service, require_api_key
from ..engine import Admission, EngineService, Job
from ..errors import STREAMED_RESPONSES
from ..generation import merged, respond, sse_event
from ..schemas import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage, new_id

router = APIRouter(tags=["completions"], dependencies=[Depends(require_api_key)])


def append_logprobs(target: CompletionLogprobs, positions, token_ids, offset: int, decode=None) -> int:
    """Extend the legacy completions logprobs; returns the text offset after these tokens."""
    for position, token_id in zip(positions, token_ids):
        if position is None:  # the first prompt token has no logprob
            token = decode([token_id]) if decode else ""
            target.tokens.append(token)
            target.token_logprobs.append(None)
            target.top_logprobs.append(None)
            target.text_offset.append(offset)
            offset += len(token)
            continue
        chosen = position[token_id]
        token = chosen.decoded_token or ""
        target.tokens.append(token)
        target.token_logprobs.append(max(chosen.logprob, -9999.0))
        target.top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, -9999.0) for lp in position.values()})
        target.text_offset.append(offset)
        offset += len(token)
    return offset


@router.post("/v1/completions", response_model=Completion, responses=STREAMED_RESPONSES)
async def completions(body: CompletionRequest, request: Request, service: EngineService = Depends(ready_service)):
    arrival = time.perf_counter()
    service.check_model(body.model)
    prompts = body.prompts()
    admission = service.admit(len(prompts) * body.n, param="n" if body.n > 1 else "prompt")
    with admission.released_on_error():
        token_prompts = [p if isinstance(p, list) else await asyncio.to_thread(service.encode_text, p) for p in prompts]
        jobs = service.build_jobs(token_prompts, body, new_id("cmpl"), prompt_param="prompt", logprobs=body.logprobs,
                                  prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None)
    texts = [p if isinstance(p, str) else None for p in prompts] if service.config.log_prompts else [None] * len(jobs)
    return await respond(request, jobs, admission, body.stream,
                         lambda: stream_completion(service, body, jobs, prompts, arrival, texts, admission),
                         lambda: collect_completion(service, body, jobs, prompts, arrival, texts))


def prompt_text(service: EngineService, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt)


async def collect_completion(service: EngineService, body: CompletionRequest, jobs: list[Job], prompts, arrival: float,
                             texts) -> Completion:
    count = len(jobs) * body.n
    text = [""] * count
    finish: list[str | None] = [None] * count
    logprobs = [CompletionLogprobs() for _ in range(count)]
    offsets = [0] * count
    if body.echo:
        for j, prompt in enumerate(prompts):
            for i in range(body.n):
                text[j * body.n + i] = prompt_text(service, prompt)
    generated = 0
    async for j, output in merged(service, jobs, arrival, texts):
        if body.logprobs is not None and body.echo and output.prompt_logprobs:
            for i in range(body.n):
                offsets[j * body.n + i] = append_logprobs(logprobs[j * body.n + i], output.prompt_logprobs,
                                                          jobs[j].prompt_ids, 0, service.tokenizer.decode)
        for choice in output.outputs:
            k = j * body.n + choice.index
            text[k] += choice.text
            generated += len(choice.token_ids)
            if body.logprobs is not None:
                offsets[k] = append_logprobs(logprobs[k], choice.logprobs or [], choice.token_ids, offsets[k])
            finish[k] = choice.finish_reason or finish[k]
    prompt_tokens = sum(len(job.prompt_ids) for job in jobs)
    return Completion(
        id=jobs[0].request_id.rsplit("-", 1)[0], model=service.model_name,
        choices=[CompletionChoice(index=k, text=text[k], finish_reason=finish[k],
                                  logprobs=logprobs[k] if body.logprobs is not None else None) for k in range(count)],
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated),
        context_extension=jobs[0].settings.canonical())


async def stream_completion(service: EngineService, body: CompletionRequest, jobs: list[Job], prompts, arrival: float,
                            texts, admission: Admission) -> AsyncIterator[str]:
    completion_id, created = jobs[0].request_id.rsplit("-", 1)[0], int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(Completion(id=completion_id, created=created, model=service.model_name, choices=choices,
                                    usage=usage).model_dump(exclude_none=True))

    try:
        if body.echo:
            yield chunk([CompletionChoice(index=j * body.n + i, text=prompt_text(service, prompt))
                         for j, prompt in enumerate(prompts) for i in range(body.n)])
        generated, offsets = 0, [0] * (len(jobs) * body.n)
        async for j, output in merged(service, jobs, arrival, texts):
            for choice in output.outputs:
                generated += len(choice.token_ids)
                if not choice.text and not choice.finish_reason:
                    continue
                k = j * body.n + choice.index
                logprobs = None
                if body.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    offsets[k] = append_logprobs(logprobs, choice.logprobs or [], choice.token_ids, offsets[k])
                yield chunk([CompletionChoice(index=k, text=choice.text, logprobs=logprobs,
                                              finish_reason=choice.finish_reason)])
        if body.stream_options and body.stream_options.include_usage:
            prompt_tokens = sum(len(job.prompt_ids) for job in jobs)
            yield chunk([], Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                                  total_tokens=prompt_tokens + generated))
    finally:
        admission.release()
