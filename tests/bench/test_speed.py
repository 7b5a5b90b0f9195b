"""The speed comparison's report (its runs start two real engines for half an hour: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json

from bench import readme, speed


def test_bench_readme_shows_the_committed_results():
    """Rerun `python -m bench readme` after a speed run."""
    assert readme.shown("speed") == readme.generated("speed")


def test_the_table_holds_every_config_at_every_main_length_and_the_batch():
    report = json.loads((speed.RESULTS / "speed.json").read_text())
    text = speed.markdown(report)
    for length in report["lengths"]:
        assert all(f"| {length // 1024}k | {config} |" in text for config in speed.CONFIGS)
    assert f"x{report['batch8']['throughput_ratio']:.2f}" in text


def test_cached_medians_and_ratios_follow_the_samples_and_the_targets_are_read():
    samples = {"stock": {"16384": [0.050, 0.040, 0.060]}, "rerope": {"16384": [0.045, 0.044, 0.046]},
               "leaky_rerope": {"16384": [0.060, 0.055, 0.058]}, "ntk_mixed": {"16384": [0.050, 0.049, 0.051]}}
    head = {"date": "2026-12-01T00:00:00+00:00", "machine": "test", "model": "m", "dtype": "bfloat16",
            "attention_precision": "float32", "reps": 3, "decode_tokens": 64, "lengths": [16384]}
    report = speed.summary(samples, head)
    assert report["median"]["stock"]["16384"] == 0.050
    assert abs(report["ratio_to_stock"]["leaky_rerope"]["16384"] - 1.16) < 1e-9
    table = speed.cached_markdown(report)
    assert "| 16k | rerope | 45.0 | 0.90 |" in table
    # ntk_mixed at exactly its target (1.00x) meets it; leaky_rerope does not
    assert table.endswith("not met by leaky_rerope at 16k (1.16x).")


def test_an_fp8_run_reads_both_its_targets_against_stock_and_its_own_auto_cache():
    """With an fp8 cache each method is also timed on the plugin's cache of the model's dtype:
    at most 1.0x stock's fp8 and 0.8x its own auto cache (issue 54)."""
    fp8 = {"stock": 0.050, "rerope": 0.039, "leaky_rerope": 0.052, "ntk_mixed": 0.041}
    auto = {"rerope": 0.050, "leaky_rerope": 0.070, "ntk_mixed": 0.045}
    samples = {**{c: {"16384": [t]} for c, t in fp8.items()},
               **{c + speed.AUTO_CACHE: {"16384": [t]} for c, t in auto.items()}}
    head = {"date": "2026-12-01T00:00:00+00:00", "machine": "test", "model": "m", "dtype": "bfloat16",
            "kv_cache_dtype": "fp8", "reps": 1, "decode_tokens": 64, "lengths": [16384]}
    report = speed.summary(samples, head)
    assert set(report["ratio_to_auto_cache"]) == {"rerope", "leaky_rerope", "ntk_mixed"}
    assert abs(report["ratio_to_auto_cache"]["ntk_mixed"]["16384"] - 0.041 / 0.045) < 1e-9
    table = speed.cached_markdown(report)
    assert "| 16k | rerope | 39.0 | 0.78 | 0.78 |" in table and "| 16k | rerope@auto-cache | 50.0 | 1.00 | - |" in table
    stock_line, own_line = table.splitlines()[-2:]
    assert stock_line.endswith("not met by leaky_rerope at 16k (1.04x).")
    assert own_line.endswith("not met by ntk_mixed at 16k (0.91x).")  # rerope (0.78x) and leaky_rerope (0.74x) meet it


def test_cached_runs_take_their_own_defaults_and_results_file():
    cached, fresh = speed.parse_args(["--cached", "--dtype", "bfloat16"]), speed.parse_args([])
    assert (cached.lengths, cached.reps, cached.decode_tokens, cached.scaling_lengths) == ([16384, 32768], 7, 64, [])
    assert cached.out.name == "tpot_bfloat16.json" and fresh.out.name == "speed.json"
    assert (fresh.lengths, fresh.reps, fresh.decode_tokens) == ([2048, 8192, 16384], 3, 32)
