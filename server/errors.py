"""Every error leaves as the OpenAI body ``{"error": {"message", "type", "param", "code"}}``,
from one place: bad input is a 4xx naming the field, never a 500.

Each failed request writes one log line (status, route, code, the reason, cut short); only an
internal error writes a traceback, and a client that hung up writes neither. Nothing here
re-raises to the ASGI server: that would log a second traceback and close the client's
keep-alive connection.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rope_plugins.server.schemas import ErrorBody, ErrorResponse, HealthStatus, SamplingFields

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}
# What the routes document besides their answer (FastAPI's own 422 is never sent: see app.py)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 413, 429, 500, 503)}
STREAMED_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    # one server-sent event (what an event-stream client reads: its data, its event type)
    200: {"content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "description": "with stream true, one event per chunk: data is the chunk as JSON (or an error body), "
                       "and the last event's data is [DONE]",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}},
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: {"model": HealthStatus}}
# An error message quotes at most this much (of a field's value, of an exception's text).
MESSAGE_LIMIT = 1000
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error with its HTTP status and the OpenAI body fields. ``logged`` is set once the
    request's log line carries it (the engine-side path logs its own line)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.logged = False

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    @property
    def server_side(self) -> bool:
        return self.status >= 500


class ClientDisconnected(Exception):
    """The client hung up before its answer was ready; its engine requests were aborted."""


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read, so that FastAPI's body parsing passes it through."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes")


# ---- the catalogue: every error a route raises, by kind ------------------------------------

# vLLM's parameter names, as the API calls them
API_PARAMS = {"extra_args": "context_extension", "prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_length_exceeded(message: str, param: str) -> APIError:
    """A prompt, or a prompt with its completion, longer than the served context."""
    return bad_request(message, param=param, code="context_length_exceeded")


def model_not_found(name: str, served: str) -> APIError:
    return bad_request(f"model {name!r} is not served here; this server serves {served!r}", param="model",
                       code="model_not_found")


def invalid_settings(message: str, field: str | None) -> APIError:
    """A context_extension value the settings refuse (``field`` is the settings field, if one)."""
    param = f"context_extension.{field}" if field else "context_extension"
    return bad_request(message, param=param, code="invalid_context_extension")


def request_too_large(param: str, count: int, capacity: int) -> APIError:
    """More sequences (prompts x n) than the server ever holds at once: retrying cannot help."""
    return bad_request(f"{param}: this request needs {count} sequences (prompts x n); this server holds at most "
                       f"{capacity} at once", param=param, code="request_too_large")


def engine_refusal(error: Exception) -> APIError:
    """vLLM's refusal of a sampling value, as a 400 naming the API's field (vLLM names it, or
    its message starts with it: "n must be 1 when using greedy sampling")."""
    param = getattr(error, "parameter", None)
    if not param:
        first_word = str(error).split(" ", 1)[0]
        param = first_word if first_word in SamplingFields.model_fields else None
    param = API_PARAMS.get(param, param) if param else None
    return bad_request(f"{param}: {error}" if param else str(error), param=param)


def vllm_error(error: dict[str, Any]) -> APIError:
    """vLLM's error (its ``ErrorInfo`` as a dict) in this server's catalogue: the status it gave,
    the field named as the API names it."""
    status = error.get("code") if isinstance(error.get("code"), int) else 500
    message = str(error.get("message") or "refused")
    param = error.get("param")
    param = API_PARAMS.get(param, param) if isinstance(param, str) and param else None
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(status, message, param=param)


# how vLLM's refusals of a grammar begin (xgrammar's, its structured-output checks'): they name no field
GRAMMAR_REFUSAL = re.compile(r"grammar|structured output|choice|regex|json schema|invalid type", re.IGNORECASE)


def name_grammar_field(error: APIError, constraint: str | None) -> APIError:
    """A refusal that names no field but is about the request's grammar names the field that
    gave it (``response_format``, ``structured_outputs`` or ``tools``)."""
    if error.param is None and error.status == 400 and constraint and GRAMMAR_REFUSAL.search(error.message):
        error.param, error.message = constraint, f"{constraint}: {error.message}"
    return error


def invalid_api_key() -> APIError:
    return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")


def server_full(in_flight: int, capacity: int) -> APIError:
    return APIError(429, f"the server is full ({in_flight} sequences in flight, at most {capacity}); retry later",
                    code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", code="engine_unavailable")


# ---- the body ------------------------------------------------------------------------------


def printable(message: str) -> str:
    """The message cut to :data:`MESSAGE_LIMIT` and encodable as UTF-8 whatever it quotes."""
    message = message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT] + "..."
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    error = ErrorBody(message=printable(message), type=kind, param=param and printable(param), code=code)
    return ErrorResponse(error=error).model_dump()


def internal_error_body(error: Exception) -> dict[str, Any]:
    return error_body(500, f"internal error: {type(error).__name__}")


def health_status(healthy: bool) -> int:
    """What /health answers: 200 while the engine serves, 503 otherwise."""
    return 200 if healthy else 503


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**(headers or {}), **({"WWW-Authenticate": "Bearer"} if status == 401 else {})}
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status,
                        headers=headers or None)


def log_failure(method: str, path: str, status: int, message: str, code: str | None = None) -> None:
    level = logging.WARNING if status >= 500 else logging.INFO
    logger.log(level, "%s %s -> %d %s: %s", method, path, status, code or HTTPStatus(status).phrase.lower(),
               printable(message)[:300])


class ModelOutputTraceback(logging.Filter):
    """vLLM's tool parsers log a traceback when the model's tool call is not valid JSON (cut off
    by ``max_tokens``, say): that is the model's output, not a fault, and the answer carries the
    text as the model wrote it. One warning line instead."""

    LOGGERS = "vllm.tool_parsers."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(self.LOGGERS) and record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = (f"{record.getMessage()} ({type(error).__name__}: {printable(str(error))[:200]}); "
                          "the answer carries the model's text as it is")
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_model_output_tracebacks() -> None:
    """:class:`ModelOutputTraceback` on the logger of each of vLLM's tool parsers (on the loggers,
    not on handlers: vLLM configures its handlers again when an engine starts)."""
    import pkgutil

    import vllm.tool_parsers

    for module in pkgutil.iter_modules(vllm.tool_parsers.__path__):
        logger_of_module = logging.getLogger(f"{ModelOutputTraceback.LOGGERS}{module.name}")
        if not any(isinstance(found, ModelOutputTraceback) for found in logger_of_module.filters):
            logger_of_module.addFilter(ModelOutputTraceback())


# ---- request validation: the field's public name ------------------------------------------

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})
# errors that only say "this union branch was not the input's type": a poor choice to report
_WRONG_BRANCH = frozenset({"string_type", "list_type", "int_type", "int_parsing", "float_type", "float_parsing",
                           "bool_type", "bool_parsing", "model_type", "dict_type", "model_attributes_type",
                           "literal_error", "none_required"})


def _is_union_tag(part: Any) -> bool:
    """pydantic names union branches in an error's location ('str', 'list[int]', 'TextPart')."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[:1].isupper())


def field_path(location: tuple) -> str:
    """('body', 'prompt', 'list[int]', 3) -> 'prompt.3'; ('body', 'context_extension', 'window')
    -> 'context_extension.window'."""
    if location[:1] in (("body",), ("query",), ("path",)):
        location = location[1:]
    return ".".join(str(part) for part in location if not _is_union_tag(part))


def most_telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a union's errors, the one from the branch that matched the input's type."""
    return next((error for error in errors if error.get("type") not in _WRONG_BRANCH), errors[0])


def validation_error(error: RequestValidationError) -> APIError:
    first = most_telling(list(error.errors()))
    field = field_path(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {message}", code="invalid_json")
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    return bad_request(f"{field}: {message}" if field else message, param=field or None, code="invalid_value")


# ---- the handlers --------------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        if not error.logged:
            log_failure(request.method, request.url.path, error.status, error.message, error.code)
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return await _api_error(request, validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else HTTPStatus(error.status_code).phrase
        return await _api_error(request, APIError(error.status_code, message, headers=error.headers))

    app.add_middleware(RequestGuard, max_body_bytes=app.state.config.max_request_bytes)


class RequestGuard:
    """The outermost layer: bodies past ``max_body_bytes`` are refused (413) before they are
    read whole; an exception no handler took becomes a 500 in the OpenAI shape with one
    traceback; a client that hung up ends its request quietly."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope.get("method", ""), scope.get("path", "")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            error = BodyTooLarge(self.max_body_bytes)
            log_failure(method, path, 413, error.detail)
            return await error_response(413, error.detail)(scope, receive, send)
        received, started = 0, False

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except ClientDisconnected:
            logger.info("%s %s: the client disconnected; its requests were aborted", method, path)
        except Exception as error:
            logger.exception("internal error on %s %s", method, path)
            if not started:
                await error_response(500, f"internal error: {type(error).__name__}")(scope, receive, send)
