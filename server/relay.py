"""The work behind the generation routes, in one place: a request validated by this server's
models (:mod:`server.schemas`), admitted, handed to vLLM's serving class as vLLM's own request
model, and its answer returned whole or streamed, with the settings applied in a header.

vLLM answers a refusal as an ``ErrorResponse`` value, or, once a stream has begun, as an error
event; both become this server's one error catalogue (:func:`refusal`). A stream is held
back until its first event, so that what the engine refuses on admission (a grammar it cannot
compile, say) is a 400 like any other, not an event after a 200.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import GenerationError, VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from rope_plugins.server.admission import Capacity
from rope_plugins.server.engine import EngineService
from rope_plugins.server.errors import (
    APIError,
    ClientDisconnected,
    bad_request,
    engine_refusal,
    engine_unavailable,
    internal_error_body,
    log_failure,
    name_grammar_field,
    validation_error,
    vllm_error,
)
from rope_plugins.server.extension import applied_settings, attach_extension

logger = logging.getLogger(__name__)
T = TypeVar("T")

# vLLM's serving call: (its request model, the HTTP request) -> an answer, a stream, or a refusal
Handler = Callable[[Any, Request], Awaitable[Any]]


def vllm_request(body: Any, model: type[BaseModel]) -> Any:
    """``body`` as vLLM's request ``model``, carrying its typed ``context_extension`` to the
    renderer's checks, where it is resolved (:mod:`rope_plugins.server.extension`); vLLM's own
    checks of a nested object (a tool, a response format) are a 400 naming the field."""
    try:
        request = model.model_validate(body.vllm_fields())
    except ValidationError as error:
        raise validation_error(RequestValidationError(error.errors())) from None
    except VLLMValidationError as error:  # raised by its validators, as they are not ValueErrors
        raise name_grammar_field(engine_refusal(error), body.constraint_field()) from None
    attach_extension(request, body.context_extension)
    return request


async def serve(request: Request, service: EngineService, capacity: Capacity, handler: Handler, body: Any,
                vllm_body: Any, sequences: int, sequences_param: str,
                to_events: Callable[[Any], AsyncIterator[str]] | None = None) -> Response:
    """Admit ``sequences`` (prompts x n), run vLLM's ``handler`` and answer: the collected body
    with the applied settings added, or the event stream once its first event is in; the
    admission is released when the answer is done, however it ends."""
    admission = capacity.admit(sequences, param=sequences_param)
    try:
        result = await unless_disconnected(request, open_answer(service, handler(vllm_body, request), to_events,
                                                                request.url.path, body.constraint_field()))
        headers = settings_header(vllm_body)
        if isinstance(result, BaseModel):
            admission.release()
            content = result.model_dump(mode="json", by_alias=True, exclude_none=True)
            if applied := applied_settings(vllm_body):
                content["context_extension"] = applied[0].canonical()
            return JSONResponse(content, headers=headers)
        return StreamingResponse(result, media_type="text/event-stream", headers=headers,
                                 background=BackgroundTask(admission.release))
    except BaseException:
        admission.release()
        raise


async def open_answer(service: EngineService, answer: Awaitable[Any],
                      to_events: Callable[[Any], AsyncIterator[str]] | None, path: str, constraint: str | None) -> Any:
    """vLLM's answer, a refusal raised as APIError; a stream (as server-sent events) once its
    first event is in and is not an error."""
    try:
        result = await answer
    except (VLLMValidationError, ValueError, TypeError) as error:  # vLLM's own refusals raised, as it answers them
        raise name_grammar_field(engine_refusal(error), constraint) from None
    except EngineDeadError:
        raise engine_unavailable("the engine died while serving this request; the server restarts") from None
    except GenerationError:
        raise ended_in_engine(service, constraint) from None
    if isinstance(result, ErrorResponse):
        raise name_grammar_field(refusal(service, result.error.model_dump()), constraint)
    if isinstance(result, BaseModel):
        return result
    events = to_events(result) if to_events else result
    first = await anext(events, None)
    if first is not None and (error := error_in(first)) is not None:
        await events.aclose()
        refused = refusal(service, error)
        raise ended_in_engine(service, constraint) if refused.status == 500 else name_grammar_field(refused, constraint)
    return stream_from_first(service, first, events, path)


def ended_in_engine(service: EngineService, constraint: str | None) -> APIError:
    """A request the engine ended with an error (vLLM's GenerationError: no detail crosses from
    the engine). With a healthy engine and a grammar, the grammar is what the engine gives up on
    in a request (a compile past vLLM's bound, a state that allows no token: the front tries
    both, :mod:`rope_plugins.server.grammars`, but the engine compiles again, under its own clock):
    a 400 naming the field. Otherwise the 500 it is."""
    healthy, reason = service.health()
    if not healthy:
        return engine_unavailable(reason)
    if constraint:
        return bad_request(f"{constraint}: the engine could not follow this grammar (it did not compile within "
                           f"vLLM's bound of {service.grammars.bound:g} s, or it allowed no token where the model "
                           "had to write one)",
                           param=constraint, code="invalid_grammar")
    return APIError(500, "internal error: the engine ended the request with an error")


async def stream_from_first(service: EngineService, first: str | None, events: AsyncIterator[str],
                            path: str) -> AsyncIterator[str]:
    """The stream from its first event on; an error after the 200 went out (the engine died,
    say) is an event in this server's catalogue, logged as any other refusal."""
    if first is not None:
        yield first
    async for event in events:
        if (error := error_in(event)) is not None:
            refused = refusal(service, error)
            log_failure("POST", path, refused.status, refused.message, refused.code)
            event = f"data: {json.dumps(refused.body())}\n\n"
        yield event


def error_in(event: str) -> dict[str, Any] | None:
    """The error an event carries (vLLM's ``data: {"error": {...}}``), or None."""
    for line in event.splitlines():
        if line.startswith("data: {"):
            try:
                data = json.loads(line[len("data: "):])
            except json.JSONDecodeError:
                return None
            error = data.get("error") if isinstance(data, dict) else None
            return error if isinstance(error, dict) else None
    return None


def refusal(service: EngineService, error: dict[str, Any]) -> APIError:
    """vLLM's error (its ``ErrorInfo`` as a dict) in this server's catalogue; a server error after
    the engine died is the engine's unavailability."""
    refused = vllm_error(error)
    if refused.server_side:
        healthy, reason = service.health()
        if not healthy:
            return engine_unavailable(reason)
        logger.warning("vLLM answered %d: %s", refused.status, str(error.get("message") or "refused")[:300])
    return refused


def settings_header(vllm_body: Any) -> dict[str, str]:
    """The applied settings as a response header (one JSON object; the first prompt's when several)."""
    applied = applied_settings(vllm_body)
    return {"x-context-extension": json.dumps(applied[0].canonical(), separators=(",", ":"))} if applied else {}


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


async def responses_events(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The Responses API's stream as server-sent events: each event's type and its JSON, as
    vLLM's own router writes them; an error after the 200 went out is an ``error`` event."""
    try:
        async for event in events:
            yield (f"event: {getattr(event, 'type', 'unknown')}\n"
                   f"data: {event.model_dump_json(indent=None, by_alias=True)}\n\n")
    except APIError as error:
        yield f"event: error\ndata: {json.dumps(error.body())}\n\n"
    except Exception as error:
        logger.exception("internal error in a Responses stream")
        yield f"event: error\ndata: {json.dumps(internal_error_body(error))}\n\n"
