"""``python -m rope_plugins.server``: provision the model if needed (``--model`` a short name, or none for the default),
then serve on 127.0.0.1:8000."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from rope_plugins.frontend.engine_args import compute_on_every_core
from rope_plugins.server.config import parse_config

logger = logging.getLogger(__name__)


def resolve_model(model: str | None) -> str:
    """The checkpoint directory to serve: a short name (or none, the default) is provisioned."""
    from rope_plugins.models.catalog import DEFAULT_MODEL, MODELS

    if model is None or model in MODELS:
        from rope_plugins.models.provision import provision

        return str(provision(model or DEFAULT_MODEL))
    return model


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # vLLM's own INFO lines (config dumps, compile steps) drown the server's; --log-level debug shows them
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if config.log_level == "debug" else "WARNING")
    # on a CPU one engine step (a long prompt's chunk) can pass vLLM's default 300 s limit,
    # which would kill the engine; a slow step is not a dead worker here
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    # every core to the engine's workers on a small machine, a share each when there are several: vLLM's CPU
    # thread-binding variables, set here in this process's environment for the engine process to inherit
    compute_on_every_core(config.tensor_parallel_size * config.pipeline_parallel_size)
    model = resolve_model(config.model)
    import uvicorn

    from rope_plugins.server.app import EXIT_ENGINE_FAILED, create_app
    from rope_plugins.server.slow_clients import read_deadline_protocol

    logger.info("listening on http://%s:%d (the engine starts now; /health says when it is ready)%s",
                config.host, config.port, "; the playground is at /" if config.playground else "")
    app = create_app(config, model)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=False, timeout_graceful_shutdown=config.shutdown_timeout,
                                           http=read_deadline_protocol(config.read_timeout)))
    app.state.stop_serving = lambda: setattr(server, "should_exit", True)
    server.run()
    service = app.state.service
    if service.state == "failed":
        logger.error("exiting with status %d: the engine failed (%s)", EXIT_ENGINE_FAILED, service.failure)
        write_exit_report(f"the engine failed: {service.failure}", served=service.openai is not None)
        return EXIT_ENGINE_FAILED
    return 0


def write_exit_report(reason: str, served: bool) -> None:
    """Why this process exits, for the supervisor that started it (server/supervisor.py), if one did."""
    from rope_plugins.server.supervisor import EXIT_REPORT_ENV

    if path := os.environ.get(EXIT_REPORT_ENV):
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"reason": reason[:300], "served": served}))


if __name__ == "__main__":
    sys.exit(main())
