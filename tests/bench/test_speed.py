"""The speed comparison's report (its runs start two real engines for half an hour: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json

from bench import readme, speed


def test_bench_readme_shows_the_committed_results():
    """Rerun `bench/readme.py` after a speed run."""
    assert readme.shown("speed") == readme.generated("speed")


def test_the_table_holds_every_config_at_every_main_length_and_the_batch():
    report = json.loads((speed.RESULTS / "speed.json").read_text())
    text = speed.markdown(report)
    for length in report["lengths"]:
        assert all(f"| {length // 1024}k | {config} |" in text for config in speed.CONFIGS)
    assert f"x{report['batch8']['throughput_ratio']:.2f}" in text
