"""The server's flags: flags, environment variables, validation, and the README's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from rope_plugins.server.config import ServerConfig, env_name, flag, parse_config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults_serve_the_embedded_model_on_loopback():
    config = parse_config([], environ={})
    assert config.model is None and config.host == "127.0.0.1" and config.port == 8000
    assert config.method == "auto" and config.extension_defaults() == {"method": "auto", "log_n": False}


def test_environment_variables_fill_in_and_flags_win():
    environ = {env_name("port"): "9001", env_name("api_key"): "secret", env_name("log_n"): "true",
               env_name("window"): "1024"}
    config = parse_config(["--port", "9002", "--method", "leaky_rerope"], environ=environ)
    assert config.port == 9002 and config.api_key == "secret" and config.log_n is True
    assert config.extension_defaults() == {"method": "leaky_rerope", "log_n": True, "window": 1024}


def test_the_default_factor_is_a_number_or_auto():
    assert parse_config(["--factor", "auto", "--group", "16"], environ={}).extension_defaults() == {
        "method": "auto", "log_n": False, "factor": "auto", "group": 16}
    assert parse_config([], environ={env_name("factor"): "2.5"}).factor == 2.5


@pytest.mark.parametrize("argv", [["--method", "warp"], ["--port", "eighty"], ["--auto-method", "auto"],
                                  ["--factor", "huge"]])
def test_a_bad_flag_value_exits_naming_it(argv, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert argv[0].lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_every_flag_is_in_the_readme():
    readme = README.read_text()
    for name in ServerConfig.model_fields:
        assert f"`{flag(name)}`" in readme, f"{flag(name)} is not documented in the README"
