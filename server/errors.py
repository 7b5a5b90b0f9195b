"""Every error leaves as the OpenAI body ``{"error": {"message", "type", "param", "code"}}``,
from one set of handlers: bad input is a 4xx naming the field, never a 500."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import ErrorBody, ErrorResponse

logger = logging.getLogger("rope_extend.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status and the OpenAI body fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _field_path(location: tuple) -> str:
    """('body', 'context_extension', 'window') -> 'context_extension.window'."""
    parts = [str(part) for part in location if part not in ("body", "query", "path")]
    return ".".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        field = _field_path(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {message}", code="invalid_json")
        if first.get("type") == "extra_forbidden":
            message = "unknown field"
        return error_response(400, f"{field}: {message}" if field else message, param=field or None,
                              code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else HTTPStatus(error.status_code).phrase
        return error_response(error.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(error).__name__}")
