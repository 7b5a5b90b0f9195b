"""preload_speed's comparison of the two bench/speed.py runs, on made-up runs."""

from __future__ import annotations

from bench import preload_speed


def speed_run(prefill: float, tpot: float, tokens_per_second: float) -> dict:
    return {"date": "2026-11-26T00:00:00+00:00", "machine": "m", "dtype": "bfloat16",
            "median": {config: {"2048": {"prefill": prefill, "tpot": tpot}} for config in ("stock", "rerope")},
            "batch8": {"tokens_per_second": {"plugin_mixed": tokens_per_second, "stock_plain": tokens_per_second}}}


def test_times_are_with_over_without_and_throughput_too():
    report = preload_speed.comparison(speed_run(2.0, 0.040, 20.0), speed_run(1.0, 0.030, 25.0))
    assert report["time_with_over_without"]["rerope"]["2048"] == {"prefill": 0.5, "tpot": 0.75}
    assert report["batch8_throughput_with_over_without"]["stock_plain"] == 1.25
    table = preload_speed.markdown(report)
    assert "| rerope | 2,048 | 0.50 | 0.75 |" in table and "stock_plain 1.25" in table


def test_each_variant_runs_with_its_own_preload_setting():
    assert preload_speed.VARIANTS["without"]["ROPE_EXTEND_PRELOAD"] == "0"
    assert preload_speed.VARIANTS["with"]["ROPE_EXTEND_PRELOAD"] != "0"
