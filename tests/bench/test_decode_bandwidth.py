"""decode_bandwidth's measurement on a small cache (the real kernels), and its table on a made-up report."""

from __future__ import annotations

import pytest

from bench import decode_bandwidth
from rope_plugins.ops.cpu import built_kernels


@pytest.mark.skipif(built_kernels() is None, reason="the C++ kernels need a compiler")
def test_every_run_is_timed_and_the_read_is_its_own_unit():
    result = decode_bandwidth.measure(decode_bandwidth.torch.bfloat16, layers=2, keys=1024, reps=2)
    names = {"read", "vllm", "plugin_rerope", "plugin_leaky", "plugin_rerope_in_l2", "plugin_leaky_in_l2"}
    assert set(result["seconds_per_layer"]) == names
    assert all(len(times) == 2 and min(times) > 0 for times in result["samples"].values())
    assert result["share_of_read"]["read"] == 1.0
    assert result["layer_bytes"] == 1024 * 3 * 2 * 64 * 2  # keys x kv heads x (key, value) x d x 2 bytes


def test_the_table_says_whether_the_target_is_met():
    def dtype_result(rerope: float, leaky: float) -> dict:
        seconds = {"read": 1.0, "vllm": 2.0, "plugin_rerope": rerope, "plugin_leaky": leaky,
                   "plugin_rerope_in_l2": 0.5, "plugin_leaky_in_l2": 0.6}
        return {"seconds_per_layer": seconds, "gb_per_second": {name: 1.0 / took for name, took in seconds.items()},
                "share_of_read": {name: 1.0 / took for name, took in seconds.items()}}

    report = {"date": "2026-11-26T00:00:00+00:00", "machine": "m", "keys": 32768, "layers": 30, "reps": 3,
              "dtypes": {"bfloat16": dtype_result(1.2, 1.25), "float32": dtype_result(1.1, 1.2)}}
    table = decode_bandwidth.markdown(report)
    assert "| bfloat16 | plugin_rerope | 1200.000 | 0.8 | 83% |" in table
    assert "bfloat16: the plugin's decode reads the cache at 83% (ReRoPE) and 80% (Leaky ReRoPE)" in table
    assert "(target 80%: met)" in table and "takes 0.50x and 0.60x the read's time" in table
    assert "bfloat16's attention precision float32" in table  # a report from before the field: two parts
    report["attention_precision"] = "bfloat16"
    assert "bfloat16's attention precision bfloat16" in decode_bandwidth.markdown(report)
    report["dtypes"]["bfloat16"] = dtype_result(1.2, 1.3)
    assert "bfloat16: the plugin's decode reads the cache at 83% (ReRoPE) and 77% (Leaky ReRoPE) of the read speed " \
           "(target 80%: not met)" in decode_bandwidth.markdown(report)
