"""The llama.cpp comparison's report and timing (its run builds GGUFs and runs llama.cpp and the
plugin at 16k and 32k for over an hour: a benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bench import llama_cpp_speed


def report_with(plugin_seconds: float) -> dict:
    configs = llama_cpp_speed.LLAMA_CPP_CONFIGS
    runs = {config.name: {"16384": {"prefill": 10.0 + i, "tpot": 0.05, "end_to_end": 20.0 + i}}
            for i, config in enumerate(configs)}
    runs["plugin auto, bfloat16"] = {"16384": {"prefill": plugin_seconds / 2, "tpot": 0.04,
                                               "end_to_end": plugin_seconds}}
    return {"date": "2026-11-26T00:00:00", "machine": "a CPU, 2 cores", "model": "SmolLM2-135M-Instruct",
            "llama_cpp_python": "0.3.36", "threads": 2, "llama_cpp_defaults": "f16 KV cache", "new_tokens": 256,
            "lengths": [16384], "configs": {c.name: asdict(c) for c in configs}, "runs": runs,
            "plugin_settings": {"16384": {"method": "rerope", "window": 2048, "log_n": True}}}


@pytest.mark.parametrize("plugin_seconds", [19.0, 21.5])
def test_the_table_gives_the_plugins_time_as_a_multiple_of_each_run(plugin_seconds):
    text = llama_cpp_speed.markdown(report_with(plugin_seconds))
    assert f"| 16k | llama.cpp F32, FA off | 10.0 | 50.0 | 20.0 | {plugin_seconds / 20:.2f} |" in text
    assert f"| 16k | llama.cpp Q4_1, FA off | 14.0 | 50.0 | 24.0 | {plugin_seconds / 24:.2f} |" in text


def test_every_weight_runs_with_flash_attention_off_and_on():
    names = [config.name for config in llama_cpp_speed.LLAMA_CPP_CONFIGS]
    assert len(set(names)) == 6 and all(f"llama.cpp {w}, FA {f}" in names
                                        for w in llama_cpp_speed.WEIGHTS for f in ("on", "off"))


def test_generation_timing_splits_the_first_token_from_the_rest(monkeypatch):
    clock = iter([0.0, 3.0, 5.0])  # before, at the first token, after the last
    monkeypatch.setattr(llama_cpp_speed.time, "perf_counter", lambda: next(clock))
    timing = llama_cpp_speed.time_generation(iter(range(5)), new_tokens=4)
    assert timing == {"prefill": 3.0, "tpot": 0.5, "end_to_end": 5.0}


def test_the_plugin_runs_first_and_llama_cpp_takes_turns_first():
    """So a run stopped midway has the plugin at every length it reached, and no llama.cpp
    configuration is always first."""
    run, configs = object.__new__(llama_cpp_speed.Comparison), llama_cpp_speed.LLAMA_CPP_CONFIGS
    run.engines = ["plugin"]
    orders = [run.jobs(index) for index in range(len(configs))]
    assert all(order[0] == "plugin" and sorted(map(str, order[1:])) == sorted(map(str, configs)) for order in orders)
    assert len({order[1] for order in orders}) == len(configs)
