"""The speed comparison's report (its runs start two real engines for half an hour: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json

import readme
import speed


def test_bench_readme_shows_the_committed_results():
    """Rerun `bench/readme.py` after a speed run."""
    assert readme.block(readme.DOCUMENT.read_text(), "speed") == readme.generated("speed")


def test_the_sweep_table_follows_the_medians():
    report = json.loads((speed.RESULTS / "speed.json").read_text())
    medians, sweep = speed.markdown_tables(report).split("\n\nThe scaling sweep")
    assert "| 16k | rerope |" in medians and "| 32k | rerope |" in sweep and "| 32k |" not in medians
