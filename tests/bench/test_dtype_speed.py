"""bench/dtype_speed.py's summary and verdict (its run starts two engines at 16k: a benchmark, run
by hand; bench/results holds the last one)."""

from __future__ import annotations

import pytest

from bench import dtype_speed


def samples(bf16_prefill: float) -> dict:
    return {"float32": {"2048": {"prefill": [1.0, 2.0, 1.5], "tpot": [0.02, 0.02, 0.03]}},
            "bfloat16": {"2048": {"prefill": [bf16_prefill] * 3, "tpot": [0.01] * 3}}}


@pytest.mark.parametrize("bf16_prefill, verdict", [(2.0, "bfloat16"), (6.0, "float32")])
def test_the_reply_end_to_end_decides_which_dtype_is_faster(bf16_prefill, verdict):
    """float32: 1.5 s + 256 x 20 ms = 6.62 s; bfloat16: its prefill + 256 x 10 ms."""
    median, ratio = dtype_speed.summary(samples(bf16_prefill))
    assert median["float32"]["2048"]["end_to_end"] == pytest.approx(1.5 + 256 * 0.02)
    assert ratio["2048"]["end_to_end"] == pytest.approx((bf16_prefill + 2.56) / 6.62)
    assert dtype_speed.faster(ratio) == verdict
    report = {"date": "2026-11-26T00:00:00", "machine": "a CPU", "model": "m", "reps": 3, "reply_tokens": 256,
              "lengths": [2048], "median": median, "bfloat16_over_float32": ratio, "faster": verdict}
    text = dtype_speed.markdown(report)
    assert f"| 2k | 1.5 | {bf16_prefill:.1f} | 20.0 | 10.0 | {ratio['2048']['end_to_end']:.2f} |" in text
    assert ("at every length measured" in text) == (verdict == "bfloat16")


def test_a_dtype_slower_at_one_length_is_not_the_faster():
    assert dtype_speed.faster({"2048": {"end_to_end": 0.8}, "16384": {"end_to_end": 1.2}}) == "float32"
    assert dtype_speed.faster({}) == "float32"
