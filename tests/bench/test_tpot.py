"""bench/tpot.py's report (its runs start two real engines for a quarter of an hour: a benchmark,
run by hand; bench/results holds the last one)."""

from __future__ import annotations

from bench import tpot


def test_medians_and_ratios_follow_the_samples_and_the_targets_are_read():
    samples = {"stock": {"16384": [0.050, 0.040, 0.060]}, "rerope": {"16384": [0.045, 0.044, 0.046]},
               "leaky_rerope": {"16384": [0.060, 0.055, 0.058]}, "ntk_mixed": {"16384": [0.050, 0.049, 0.051]}}
    head = {"machine": "test", "model": "m", "dtype": "bfloat16", "attention_precision": "float32", "reps": 3,
            "decode_tokens": 64, "lengths": [16384]}
    report = tpot.summary(samples, head)
    assert report["median"]["stock"]["16384"] == 0.050
    assert abs(report["ratio_to_stock"]["leaky_rerope"]["16384"] - 1.16) < 1e-9
    table = tpot.markdown(report)
    assert "| 16k | rerope | 45.0 | 0.90 |" in table
    # ntk_mixed at exactly its target (1.00x) meets it; leaky_rerope does not
    assert table.endswith("not met by leaky_rerope at 16k (1.16x).")
