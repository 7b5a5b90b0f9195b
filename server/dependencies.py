"""FastAPI dependencies: the engine service (ready, or 503), the server's capacity and the API key
(401); routes take the first two by their ``Annotated`` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rope_plugins.server.admission import Capacity
from rope_plugins.server.engine import EngineService
from rope_plugins.server.errors import invalid_api_key

_bearer = HTTPBearer(auto_error=False)


def get_service(request: Request) -> EngineService:
    return request.app.state.service


def ready_service(request: Request) -> EngineService:
    service = get_service(request)
    service.require_ready()
    return service


def get_capacity(request: Request) -> Capacity:
    return request.app.state.capacity


async def require_api_key(request: Request) -> None:
    """With ``--api-key`` set, the /v1 routes need ``Authorization: Bearer <key>``."""
    expected = request.app.state.config.api_key
    if not expected:
        return
    credentials: HTTPAuthorizationCredentials | None = await _bearer(request)
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise invalid_api_key()


# a route's engine service, ready (else 503)
ReadyService = Annotated[EngineService, Depends(ready_service)]
# the engine service in whatever state (for /health, /metrics and the playground's page)
AnyService = Annotated[EngineService, Depends(get_service)]
# the sequences in flight, for admission
ServerCapacity = Annotated[Capacity, Depends(get_capacity)]
