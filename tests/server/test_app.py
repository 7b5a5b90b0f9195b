"""The app as built from its flags, without an engine: CORS (``--allowed-origins``, off by
default) and the routes it mounts. Everything that needs the engine: tests/server/test_server.py."""

from __future__ import annotations

from fastapi.testclient import TestClient

from rope_plugins.server.app import create_app
from rope_plugins.server.config import parse_config

PAGE = "https://notebook.example"


def client(*flags: str) -> TestClient:
    """The app without its lifespan (no engine)."""
    return TestClient(create_app(parse_config(list(flags), environ={}), "unused-model-path"))


def preflight(app: TestClient, origin: str):
    return app.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_no_other_origin_may_call_the_api_by_default():
    app = client()
    assert "access-control-allow-origin" not in preflight(app, PAGE).headers
    assert "access-control-allow-origin" not in app.get("/health", headers={"Origin": PAGE}).headers


def test_allowed_origins_may_call_the_api_and_read_the_settings_header():
    app = client("--allowed-origins", f"{PAGE}, https://other.example")
    answer = preflight(app, PAGE)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    # a simple request (the engine is not started: 503, still with the CORS headers a page needs)
    unavailable = app.post("/v1/chat/completions", headers={"Origin": PAGE}, json={})
    assert unavailable.headers["access-control-allow-origin"] == PAGE
    assert "x-context-extension" in unavailable.headers["access-control-expose-headers"]
    assert "access-control-allow-origin" not in preflight(app, "https://evil.example").headers


def test_any_origin_with_a_star():
    assert preflight(client("--allowed-origins", "*"), PAGE).headers["access-control-allow-origin"] == "*"


def test_the_openai_routes_are_mounted():
    paths = {route.path for route in client().app.routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
            "/metrics", "/health"} <= paths


def test_a_tool_parsers_traceback_on_the_models_output_is_one_warning_line():
    """vLLM's hermes parser logs a traceback when a tool call the model wrote is cut off; the
    server's log gets one line instead (other loggers' tracebacks are left as they are)."""
    import io
    import json
    import logging

    from rope_plugins.server.errors import ModelOutputTraceback

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ModelOutputTraceback())
    for name in ("vllm.tool_parsers.hermes_tool_parser", "vllm.other"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            json.loads('{"name": "f", "arguments": {"x": "unterminated')
        except json.JSONDecodeError:
            logger.exception("Error in extracting tool call from response.")
        finally:
            logger.removeHandler(handler)
    parser_line, *other = stream.getvalue().split("Error in extracting tool call from response.")[1:]
    assert "JSONDecodeError: Unterminated string" in parser_line.splitlines()[0]
    assert "Traceback" not in parser_line.split("\n", 1)[0] and "Traceback" in other[0]


def test_the_app_quiets_every_tool_parsers_logger_whatever_vllm_does_to_its_handlers():
    import logging

    from rope_plugins.server.errors import ModelOutputTraceback

    client()
    for name in ("hermes_tool_parser", "llama_tool_parser"):
        assert any(isinstance(found, ModelOutputTraceback)
                   for found in logging.getLogger(f"vllm.tool_parsers.{name}").filters), name


def test_the_kv_cache_dtype_flag_reaches_the_engine_and_a_bad_one_is_refused(tiny_llama_dir):
    import pytest

    from rope_plugins.server.engine import EngineService
    from rope_plugins.server.metrics import Metrics

    for flag, expected in (([], "auto"), (["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2")):
        service = EngineService(parse_config(["--max-model-len", "256", *flag], environ={}), Metrics())
        assert service.engine_args(str(tiny_llama_dir)).kv_cache_dtype == expected
    with pytest.raises(SystemExit):
        parse_config(["--kv-cache-dtype", "int4"], environ={})
