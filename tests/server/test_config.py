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


@pytest.mark.parametrize("native, served", [(True, "bfloat16"), (False, "float32")])
def test_auto_serves_bfloat16_where_the_cpu_multiplies_it(monkeypatch, native, served):
    """The speed suite measured bfloat16 faster than float32 on a CPU with AVX512_BF16; a CPU
    without bfloat16 dot products gets float32. A named dtype is served as named, and the
    default is float32 (bench/dtype_check.py: the default model's answer flips in bfloat16)."""
    from rope_plugins.server import config

    assert parse_config([], environ={}).dtype == "float32"
    assert parse_config(["--dtype", "auto"], environ={}).dtype == "auto"
    monkeypatch.setattr(config, "has_bfloat16_dot_products", lambda: native)
    assert config.served_dtype("auto") == served
    assert config.served_dtype("float32") == "float32" and config.served_dtype("bfloat16") == "bfloat16"


def test_this_machine_reports_its_bfloat16_dot_products():
    """The check reads the CPU itself: it agrees with the kernel's flags in /proc/cpuinfo."""
    from rope_plugins.server.config import has_bfloat16_dot_products

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    if cpuinfo is None:
        pytest.skip("no /proc/cpuinfo")
    assert has_bfloat16_dot_products() == any(flag in cpuinfo.split() for flag in ("avx512_bf16", "amx_tile"))
