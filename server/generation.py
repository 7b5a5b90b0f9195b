"""Running a request's engine jobs: merged outputs, latency metrics, the per-request log
line, and abort when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from .engine import Admission, EngineService, Job
from .errors import APIError, ClientDisconnected, error_body, printable

logger = logging.getLogger(__name__)
T = TypeVar("T")


def settings_header(jobs: list[Job]) -> dict[str, str]:
    """The applied settings as a response header (one JSON object; the first prompt's when several)."""
    return {"x-context-extension": json.dumps(jobs[0].settings.canonical(), separators=(",", ":"))}


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


async def respond(request: Request, jobs: list[Job], admission: Admission, stream: bool,
                  events: Callable[[], AsyncIterator[str]], collect: Callable[[], Awaitable[BaseModel]]) -> Response:
    """The answer: an event stream, or the collected body; either way with the applied settings
    in a header, and the admission released when done."""
    headers = settings_header(jobs)
    if stream:
        return StreamingResponse(sse_stream(events()), media_type="text/event-stream", headers=headers,
                                 background=BackgroundTask(admission.release))
    try:
        answer = await unless_disconnected(request, collect())
    finally:
        admission.release()
    return JSONResponse(answer.model_dump(), headers=headers)
