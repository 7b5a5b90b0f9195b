"""The work behind /v1/chat/completions and /v1/completions, in one place: the request's engine
jobs built, their outputs merged and measured (latency metrics, one log line per job, abort
when the client goes away), and the answer collected whole or streamed as server-sent events.

The two endpoints differ only in how a choice, a chunk and the log-probabilities are shaped
(chat: a message or a delta, token logprobs; completions: text, the legacy logprobs, echo): a
small :class:`Shape` each. Collecting (:class:`Choices`) and streaming (:func:`stream_events`)
are shared.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from .engine import Admission, EngineService, Job
from .errors import APIError, ClientDisconnected, error_body, printable
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                      ChatCompletionRequest, ChoiceLogprobs, Completion, CompletionChoice, CompletionLogprobs,
                      CompletionRequest, DeltaMessage, SamplingFields, TokenLogprob, TopLogprob, Usage, new_id)

logger = logging.getLogger(__name__)
T = TypeVar("T")
LOWEST_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity)


# ---- a request's work: its jobs and how its answer is shaped -------------------------------


@dataclass
class Generation:
    """One API request's engine work: its jobs (one per prompt, ``n`` choices each: choice
    ``i`` of prompt ``j`` is the answer's choice ``j * n + i``), how the answer is shaped, when
    the request arrived, and the prompt texts its log lines quote (None: not logged)."""

    service: EngineService
    body: SamplingFields
    jobs: list[Job]
    shape: Shape
    arrival: float
    log_texts: list[str | None]

    @property
    def response_id(self) -> str:
        return self.jobs[0].response_id  # every job of the request answers the same id

    @property
    def count(self) -> int:
        return len(self.jobs) * self.body.n

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def index(self, job: int, choice: int) -> int:
        return job * self.body.n + choice

    def indices(self, job: int) -> range:
        return range(self.index(job, 0), self.index(job + 1, 0))

    def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        return merged(self.service, self.jobs, self.arrival, self.log_texts)

    def usage(self, generated: int) -> Usage:
        prompt_tokens = sum(len(job.prompt_ids) for job in self.jobs)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)


async def chat_generation(service: EngineService, body: ChatCompletionRequest, arrival: float) -> Generation:
    """One job: the messages through the model's chat template."""
    messages = [message.for_template() for message in body.messages]
    prompt_ids = await asyncio.to_thread(service.chat_prompt, messages)
    top = body.top_logprobs or 0
    jobs = service.build_jobs([prompt_ids], body, new_id("chatcmpl"), prompt_param="messages",
                              logprobs=top if body.logprobs else None, logprobs_param="top_logprobs")
    log_texts = [messages[-1]["content"] if service.config.log_prompts else None]
    return Generation(service, body, jobs, ChatShape(body.logprobs, top), arrival, log_texts)


async def completion_generation(service: EngineService, body: CompletionRequest, prompts: list[str | list[int]],
                                arrival: float) -> Generation:
    """One job per prompt: a text tokenized, token ids as they are. ``echo`` with ``logprobs``
    asks for the prompt tokens' log-probabilities too (the OpenAI way to score a text)."""
    token_prompts = [p if isinstance(p, list) else await asyncio.to_thread(service.encode_text, p) for p in prompts]
    echo_logprobs = body.echo and body.logprobs is not None
    jobs = service.build_jobs(token_prompts, body, new_id("cmpl"), prompt_param="prompt", logprobs=body.logprobs,
                              prompt_logprobs=body.logprobs if echo_logprobs else None)
    log_texts = [p if isinstance(p, str) and service.config.log_prompts else None for p in prompts]
    echoed = [p if isinstance(p, str) else service.tokenizer.decode(p) for p in prompts] if body.echo else None
    shape = CompletionShape(body.n, body.logprobs, echoed, service.tokenizer.decode)
    return Generation(service, body, jobs, shape, arrival, log_texts)


async def respond(request: Request, generation: Generation, admission: Admission) -> Response:
    """The answer: an event stream, or the collected body; either way with the applied settings
    in a header, and the admission released when done."""
    headers = settings_header(generation.jobs)
    if generation.body.stream:
        return StreamingResponse(sse_stream(stream_events(generation, admission)), media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(admission.release))
    try:
        answer = await unless_disconnected(request, collect(generation))
    finally:
        admission.release()
    return JSONResponse(answer.model_dump(), headers=headers)


def settings_header(jobs: list[Job]) -> dict[str, str]:
    """The applied settings as a response header (one JSON object; the first prompt's when several)."""
    return {"x-context-extension": json.dumps(jobs[0].settings.canonical(), separators=(",", ":"))}


# ---- collected or streamed: the same for both endpoints ------------------------------------


@dataclass
class Choice:
    """One choice of a collected answer, so far."""

    text: str
    logprobs: Any
    finish_reason: str | None = None


class Choices:
    """A collected answer's choices as the engine's deltas arrive: each one's text, finish
    reason and log-probabilities, and the tokens generated in all."""

    def __init__(self, generation: Generation) -> None:
        self.generation, self.shape = generation, generation.shape
        self.choices = [Choice(text, self.shape.empty_logprobs()) for text in self.shape.first_texts(generation.count)]
        self.generated = 0

    def add(self, job: int, output: Any) -> None:
        """One engine output (deltas of some of ``job``'s choices)."""
        if output.prompt_logprobs:
            for index in self.generation.indices(job):
                prompt = self.shape.prompt_logprobs(index, self.generation.jobs[job].prompt_ids, output.prompt_logprobs)
                if prompt is not None:
                    self.choices[index].logprobs.extend(prompt)
        for delta in output.outputs:
            index = self.generation.index(job, delta.index)
            choice = self.choices[index]
            choice.text += delta.text
            self.generated += len(delta.token_ids)
            logprobs = self.shape.logprobs(index, delta.logprobs, delta.token_ids)
            if logprobs is not None:
                choice.logprobs.extend(logprobs)
            choice.finish_reason = delta.finish_reason or choice.finish_reason

    def answer(self) -> BaseModel:
        generation, shape = self.generation, self.shape
        return shape.answer_model(
            id=generation.response_id, model=generation.service.model_name,
            choices=[shape.choice(index, choice.text, choice.logprobs, choice.finish_reason)
                     for index, choice in enumerate(self.choices)],
            usage=generation.usage(self.generated), context_extension=generation.jobs[0].settings.canonical())


async def collect(generation: Generation) -> BaseModel:
    """The whole answer, once every job is done."""
    choices = Choices(generation)
    async for job, output in generation.outputs():
        choices.add(job, output)
    return choices.answer()


async def stream_events(generation: Generation, admission: Admission) -> AsyncIterator[str]:
    """The answer as events: the shape's opening chunk (if any), a chunk per delta that carries
    text or a finish, and the usage last when asked; the admission is released however it ends."""
    shape, created = generation.shape, int(time.time())

    def event(choices: list[Any], usage: Usage | None = None) -> str:
        chunk = shape.chunk_model(id=generation.response_id, created=created, model=generation.service.model_name,
                                  choices=choices, usage=usage)
        return sse_event(chunk.model_dump(exclude_none=True))

    try:
        if opening := shape.opening(generation.count):
            yield event(opening)
        generated = 0
        async for job, output in generation.outputs():
            for delta in output.outputs:
                generated += len(delta.token_ids)
                if not delta.text and not delta.finish_reason:
                    continue
                index = generation.index(job, delta.index)
                logprobs = shape.logprobs(index, delta.logprobs, delta.token_ids)
                yield event([shape.chunk_choice(index, delta.text, logprobs, delta.finish_reason)])
        if generation.include_usage:
            yield event([], generation.usage(generated))
    finally:
        admission.release()


# ---- what each endpoint shapes its own way -------------------------------------------------


class Shape(abc.ABC):
    """How one endpoint shapes its answer: its answer and chunk models, a choice in each, the
    log-probabilities of a delta, and what the choices start with."""

    answer_model: type[BaseModel]
    chunk_model: type[BaseModel]

    def first_texts(self, count: int) -> list[str]:
        """The text each of the ``count`` choices starts with."""
        return [""] * count

    @abc.abstractmethod
    def opening(self, count: int) -> list[Any]:
        """The choices of a stream's first chunk (none: no first chunk)."""

    @abc.abstractmethod
    def empty_logprobs(self) -> Any:
        """A choice's log-probabilities before any token (None: not asked for)."""

    @abc.abstractmethod
    def logprobs(self, index: int, positions: Any, token_ids: list[int]) -> Any:
        """The log-probabilities of choice ``index``'s new tokens (None: not asked for), from
        vLLM's per-position {token id: Logprob}."""

    def prompt_logprobs(self, index: int, prompt_ids: list[int], positions: Any) -> Any:
        """The prompt's log-probabilities, ahead of choice ``index``'s own (None: not part of it)."""
        return None

    @abc.abstractmethod
    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> BaseModel:
        """A collected answer's choice."""

    @abc.abstractmethod
    def chunk_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> BaseModel:
        """A streamed chunk's choice."""


class ChatShape(Shape):
    """Chat: a message (a delta when streamed, after one that says the role), token logprobs."""

    answer_model, chunk_model = ChatCompletion, ChatCompletionChunk

    def __init__(self, with_logprobs: bool, top: int) -> None:
        self.with_logprobs, self.top = with_logprobs, top

    def opening(self, count: int) -> list[ChatChunkChoice]:
        return [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(count)]

    def empty_logprobs(self) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(content=[]) if self.with_logprobs else None

    def logprobs(self, index: int, positions: Any, token_ids: list[int]) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(content=token_logprobs(positions, token_ids, self.top)) if self.with_logprobs else None

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> ChatChoice:
        return ChatChoice(index=index, message=AssistantMessage(content=text), logprobs=logprobs,
                          finish_reason=finish_reason)

    def chunk_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=DeltaMessage(content=text or None), logprobs=logprobs,
                               finish_reason=finish_reason)


class CompletionShape(Shape):
    """Text completions: text choices, the legacy logprobs (each choice's text offsets run on
    from delta to delta), and ``echo``: each choice starts with its prompt's text (and, when
    collected with logprobs, its prompt tokens' log-probabilities)."""

    answer_model = chunk_model = Completion

    def __init__(self, n: int, top: int | None, echoed: list[str] | None, decode: Callable[[list[int]], str]) -> None:
        self.n, self.top, self.echoed, self.decode = n, top, echoed, decode
        self.offsets: dict[int, int] = {}

    def first_texts(self, count: int) -> list[str]:
        return [text for text in self.echoed for _ in range(self.n)] if self.echoed else [""] * count

    def opening(self, count: int) -> list[CompletionChoice]:
        if not self.echoed:
            return []
        return [CompletionChoice(index=index, text=text) for index, text in enumerate(self.first_texts(count))]

    def empty_logprobs(self) -> CompletionLogprobs | None:
        return CompletionLogprobs() if self.top is not None else None

    def logprobs(self, index: int, positions: Any, token_ids: list[int]) -> CompletionLogprobs | None:
        if self.top is None:
            return None
        delta = CompletionLogprobs()
        self.offsets[index] = append_logprobs(delta, positions or [], token_ids, self.offsets.get(index, 0))
        return delta

    def prompt_logprobs(self, index: int, prompt_ids: list[int], positions: Any) -> CompletionLogprobs | None:
        if self.top is None or self.echoed is None:
            return None
        prompt = CompletionLogprobs()
        self.offsets[index] = append_logprobs(prompt, positions, prompt_ids, 0, self.decode)
        return prompt

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    chunk_choice = choice


def token_logprobs(positions: Any, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """OpenAI chat logprobs from vLLM's per-position {token id: Logprob}."""
    entries = []
    for position, token_id in zip(positions or [], token_ids):
        chosen = position[token_id]
        ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 0)[:top]
        entries.append(TokenLogprob(
            token=chosen.decoded_token or "", logprob=max(chosen.logprob, LOWEST_LOGPROB),
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=max(lp.logprob, LOWEST_LOGPROB),
                                     bytes=list((lp.decoded_token or "").encode())) for lp in ranked]))
    return entries


def append_logprobs(target: CompletionLogprobs, positions: Any, token_ids: list[int], offset: int,
                    decode: Callable[[list[int]], str] | None = None) -> int:
    """Extend the legacy completions logprobs; returns the text offset after these tokens. A
    position without logprobs (the first prompt token's) gets the token's text from ``decode``."""
    for position, token_id in zip(positions, token_ids):
        if position is None:
            token = decode([token_id]) if decode else ""
            target.tokens.append(token)
            target.token_logprobs.append(None)
            target.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            token = chosen.decoded_token or ""
            target.tokens.append(token)
            target.token_logprobs.append(max(chosen.logprob, LOWEST_LOGPROB))
            target.top_logprobs.append({(lp.decoded_token or ""): max(lp.logprob, LOWEST_LOGPROB)
                                        for lp in position.values()})
        target.text_offset.append(offset)
        offset += len(token)
    return offset


# ---- running the jobs ----------------------------------------------------------------------


async def tracked(service: EngineService, job: Job, arrival: float, prompt_text: str | None = None) -> AsyncIterator[Any]:
    """The job's engine outputs, measured: TTFT, inter-token latency, end-to-end, token
    counts by method; one log line when it ends, however it ends."""
    metrics, method = service.metrics, job.label
    first = last = None
    generated, outcome, finish, reason = 0, "error", None, ""
    try:
        async for output in service.generate(job):
            now = time.perf_counter()
            new = sum(len(choice.token_ids) for choice in output.outputs)
            if new:
                if first is None:
                    first = now
                    metrics.time_to_first_token.labels(method).observe(now - arrival)
                elif last is not None:
                    for _ in range(new):
                        metrics.inter_token_latency.labels(method).observe((now - last) / new)
                last = now
                generated += new
            finish = ",".join(sorted({c.finish_reason for c in output.outputs if c.finish_reason})) or finish
            yield output
        outcome = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "aborted"
        raise
    except APIError as error:  # this line is the request's one log line for it
        error.logged = True
        reason = f" error={error.status}:{printable(error.message)[:200]!r}"
        raise
    except Exception as error:
        reason = f" error={type(error).__name__}"
        raise
    finally:
        elapsed = time.perf_counter() - arrival
        metrics.requests.labels(method, outcome).inc()
        metrics.prompt_tokens.labels(method).inc(len(job.prompt_ids))
        metrics.generation_tokens.labels(method).inc(generated)
        if outcome == "ok":
            metrics.end_to_end_latency.labels(method).observe(elapsed)
        ttft = f"{first - arrival:.2f}s" if first is not None else "-"
        logger.log(logging.WARNING if outcome == "error" else logging.INFO,
                   "%s %s settings=%s prompt=%d completion=%d ttft=%s e2e=%.2fs finish=%s%s%s", job.request_id,
                   outcome, json.dumps(job.settings.canonical(), separators=(",", ":")), len(job.prompt_ids),
                   generated, ttft, elapsed, finish or "-", reason,
                   f" prompt_text={prompt_text!r}" if prompt_text is not None else "")


async def merged(service: EngineService, jobs: list[Job], arrival: float,
                 prompt_texts: list[str | None]) -> AsyncIterator[tuple[int, Any]]:
    """(job index, output) from all jobs as they come."""
    if len(jobs) == 1:
        async for output in tracked(service, jobs[0], arrival, prompt_texts[0]):
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, job: Job) -> None:
        try:
            async for output in tracked(service, job, arrival, prompt_texts[index]):
                await queue.put((index, output))
        except Exception as error:  # surfaced to the consumer
            await queue.put((index, error))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T], poll: float = 0.25) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


def sse_event(data: dict[str, Any] | str, raw: bool = False) -> str:
    """One server-sent event as the OpenAI streaming API sends it: ``data: {json}``."""
    return f"data: {data if raw else json.dumps(data, separators=(',', ':'))}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then ``[DONE]``; an error after the 200 went out travels as an error event
    (the OpenAI body), and the stream still ends with ``[DONE]``."""
    try:
        async for event in events:
            yield event
    except APIError as error:
        yield sse_event(error.body())
    except Exception as error:
        logger.exception("internal error in a stream")
        yield sse_event(error_body(500, f"internal error: {type(error).__name__}"))
    yield "data: [DONE]\n\n"
