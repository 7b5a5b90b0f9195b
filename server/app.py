"""The FastAPI application: routers, error handlers, and the engine's lifecycle.

The engine starts in the background once the app is up, so /health answers (503, "starting")
while the model loads, which is what startup probes expect; the /v1 routes answer 503 until
it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib.metadata import version

from fastapi import FastAPI

from .config import ServerConfig
from .engine import EngineService
from .errors import install_error_handlers
from .metrics import Metrics
from .routes import chat, completions, models, system

logger = logging.getLogger("rope_extend.server")


def create_app(config: ServerConfig, model: str) -> FastAPI:
    service = EngineService(config, Metrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(service.start(model))
        yield
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        service.shutdown()
        logger.info("engine stopped; bye")

    app = FastAPI(title="rope-extend-server", version=version("rope-extend-server"), lifespan=lifespan,
                  description="OpenAI-compatible serving past the training context, with per-request RoPE extension.")
    app.state.service, app.state.config = service, config
    install_error_handlers(app)
    for router in (chat.router, completions.router, models.router, system.router):
        app.include_router(router)
    return app
