"""bench/soak.py: the prompt lengths follow their law, the memory slope's interval holds the truth
(correlated samples included), the worker's allocator lines, and the windows and the report render."""

from __future__ import annotations

import random

from bench import soak


def test_prompt_lengths_span_the_served_range_with_long_ones_rare():
    rng = random.Random(0)
    lengths = [soak.prompt_length(rng) for _ in range(20000)]
    assert 1024 <= min(lengths) and max(lengths) <= soak.SERVED - 128
    over_16k = sum(length > 16384 for length in lengths) / len(lengths)
    # density 1/L² on [1024, 32640]: P(L > 16384) = (1/16384 - 1/32640) / (1/1024 - 1/32640) = 3.1%
    assert 0.025 < over_16k < 0.037
    assert sum(length > 30000 for length in lengths) > 0, "the served maximum's neighbourhood is reached"


def test_memory_slope_interval_holds_a_known_leak_and_excludes_zero():
    rng = random.Random(1)
    samples = [{"t_s": t, "rss_mib": 5000 + 100 * t / 3600 + rng.gauss(0, 20)} for t in range(0, 3600, 5)]
    slope = soak.rss_slope(samples)
    assert slope["low"] < 100 < slope["high"] and slope["low"] > 0
    flat = soak.rss_slope([{"t_s": s["t_s"], "rss_mib": 5000 + rng.gauss(0, 20)} for s in samples])
    assert flat["low"] < 0 < flat["high"]


def test_windows_and_report_render():
    records = [{"t_s": 30.0 * i, "status": 200, "server_error": False, "abandoned": i % 4 == 0,
                "ttft_s": 1.0 + i, "tpot_s": 0.1} for i in range(20)]
    windows = soak.windows(records, minutes=10)
    assert [w["requests"] for w in windows] == [10, 10]
    assert windows[0]["ttft_p50"] in (5.0, 6.0) and windows[0]["ttft_p99"] == 10.0
    samples = [{"t_s": float(t), "rss_mib": 5000.0} for t in range(0, 600, 5)]
    report = {"date": "2026-11-28T00:00:00+00:00", "minutes": 10, "clients": 32, "requests": 20,
              "answers_by_status": {"200": 20}, "prompt_tokens": [1024, 30000],
              "tracebacks_in_log": 0, "server_errors": 0, "abandoned": 5, "restarts": 0,
              "rss_start_mib": 5000, "rss_peak_mib": 5000, "rss_end_mib": 5000, "rss_slope": soak.rss_slope(samples),
              "windows": windows, "rss": samples, "warm_up": None, "allocated_slope": None}
    text = soak.markdown(report)
    assert "| answered 5xx | 0 |" in text and "by process" not in text  # no process named


def test_the_report_names_the_process_whose_memory_rises():
    rng = random.Random(2)
    samples = [{"t_s": float(t), "by_process": {"python": 900 + rng.gauss(0, 1),
                                                "VLLM::Worker": 3800 + 200 * t / 3600 + rng.gauss(0, 5)}}
               for t in range(0, 3600, 5)]
    slopes = soak.slopes_by_process(samples)
    assert slopes["VLLM::Worker"]["low"] > 150 and slopes["python"]["high"] < 5


def test_correlated_samples_widen_the_interval_past_a_false_leak():
    """A flat memory that wanders for minutes at a time (prompts in flight), sampled every 5 s:
    errors that took the samples as independent would call its chance slope a leak."""
    rng = random.Random(3)
    level, samples = 0.0, []
    for t in range(0, 3600, 5):
        level = 0.98 * level + rng.gauss(0, 4)  # correlated over ~4 minutes
        samples.append({"t_s": float(t), "rss_mib": 5000 + level})
    slope = soak.rss_slope(samples)
    assert slope["low"] < 0 < slope["high"]


def test_the_workers_memory_lines_become_samples_from_the_clock():
    from rope_plugins.worker.memory import memory_line

    lines = [memory_line({"allocated": 3000 * 2**20, "resident": 3600 * 2**20}, at) for at in (95.0, 100.0, 110.5)]
    log = "\n".join(["12:00:00 WARNING other: worker memory is a phrase", *lines, "Traceback (most recent call last):"])
    samples = soak.worker_allocator(log, began=100.0)
    assert samples == [{"t_s": 0.0, "allocator": {"allocated": 3000.0, "resident": 3600.0}},
                       {"t_s": 10.5, "allocator": {"allocated": 3000.0, "resident": 3600.0}}]
