"""The FastAPI application: routers, error handlers, and the engine's lifecycle.

The engine starts in the background once the app is up, so /health answers (503, "starting")
while the model loads, which is what startup probes expect; the /v1 routes answer 503 until
it is ready.

If the engine fails to start, or dies later, the server does not linger serving 503: the
requests in flight fail (503; a stream gets an error event and ``[DONE]``), then the app asks
its ASGI server to stop (``app.state.stop_serving``) and ``python -m rope_plugins.server`` exits with
status :data:`EXIT_ENGINE_FAILED`, so that whatever supervises it (compose's restart policy,
Kubernetes, systemd) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from importlib.metadata import version
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from rope_plugins.server.admission import Capacity
from rope_plugins.server.config import ServerConfig
from rope_plugins.server.engine import EngineService
from rope_plugins.server.errors import install_error_handlers, quiet_model_output_tracebacks
from rope_plugins.server.metrics import Metrics
from rope_plugins.server.routes import chat, completions, models, playground, responses, system

logger = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3
# how long the requests in flight get to fail on their own once the engine is gone
FAILING_GRACE_SECONDS = 30.0


async def stop_when_the_engine_fails(app: FastAPI, poll: float = 0.5) -> None:
    """Wait for the engine to fail (at start or later), let what was in flight fail, then stop
    serving so that the process exits with :data:`EXIT_ENGINE_FAILED`."""
    service: EngineService = app.state.service
    capacity: Capacity = app.state.capacity
    while service.state != "failed":
        await asyncio.sleep(poll)
        service.health()  # notices an engine that died
        if service.state == "stopping":
            return
    logger.error("the engine failed (%s); failing the %d sequences in flight, then exiting with status %d so that "
                 "a supervisor starts a new server", service.failure, capacity.in_flight, EXIT_ENGINE_FAILED)
    service.metrics.engine_gone()
    deadline = time.monotonic() + FAILING_GRACE_SECONDS
    while capacity.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(poll)
    app.state.stop_serving()


def create_app(config: ServerConfig, model: str) -> FastAPI:
    metrics = Metrics()
    service = EngineService(config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        starting = asyncio.create_task(service.start(model))
        watching = asyncio.create_task(stop_when_the_engine_fails(app))
        yield
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        watching.cancel()
        service.shutdown()
        logger.info("engine stopped; bye")

    app = FastAPI(title="rope-extend-server", version=version("rope-extend-server"), lifespan=lifespan,
                  description="OpenAI-compatible serving past the training context, with per-request RoPE extension.")
    app.state.service, app.state.config = service, config
    app.state.capacity = Capacity(config.max_num_seqs + config.max_waiting, metrics)
    # the entry point replaces this with its ASGI server's stop (tests build apps without one)
    app.state.stop_serving = lambda: logger.warning("the engine failed and nothing can stop this app")
    install_error_handlers(app)
    quiet_model_output_tracebacks()
    if config.allowed_origins:
        # browsers of these origins may call the API (off by default: the playground is same-origin)
        origins = [origin.strip() for origin in config.allowed_origins.split(",") if origin.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["x-context-extension"])
    for router in (chat.router, completions.router, responses.router, models.router, system.router):
        app.include_router(router)
    if config.playground:
        app.include_router(playground.router)
        app.mount(playground.ASSETS_AT, StaticFiles(directory=playground.PAGE), name="playground")
    document_real_responses(app, service.model_name or Path(model).name)
    return app


def document_real_responses(app: FastAPI, model_name: str) -> None:
    """The schema as this server answers: FastAPI documents a 422 for every body, but bad input
    gets a 400 (the OpenAI way), so the 422 and its models go; ``model`` shows the served one."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()
            for operations in document.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "TokenizeRequest"):
                schemas.get(name, {}).get("properties", {}).get("model", {})["examples"] = [model_name]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
