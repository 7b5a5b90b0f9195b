"""The browser playground at ``/``: a page the app serves itself (no build step, nothing
fetched from elsewhere) that compares extension settings side by side through the public API.
``--no-playground`` leaves it out."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from pydantic import BaseModel

from rope_plugins.rules.methods import METHODS
from rope_plugins.server.config import AUTO, ServerConfig
from rope_plugins.server.dependencies import AnyService

PAGE = Path(__file__).resolve().parent.parent / "playground"
ASSETS_AT = "/playground/static"  # the page's script and style (index.html names them)

router = APIRouter(include_in_schema=False)


class PlaygroundSetup(BaseModel):
    """What the page offers: each method with the settings fields it reads ('auto' first, as
    the server resolves it), and the server's default method for the first column."""

    methods: dict[str, list[str]]
    default_method: str


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(PAGE / "index.html")


@router.get("/playground/setup.json", response_model=PlaygroundSetup)
async def setup(service: AnyService) -> PlaygroundSetup:
    config: ServerConfig = service.config
    methods = {AUTO: [], **{name: list(method.fields) for name, method in METHODS.items()}}
    return PlaygroundSetup(methods=methods, default_method=config.method)
