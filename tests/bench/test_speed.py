"""The speed comparison's report (its runs start two real engines for half an hour: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json

from bench import readme, speed


def test_bench_readme_shows_the_committed_results():
    """Rerun `bench/readme.py` after a speed run."""
    assert readme.block(readme.DOCUMENT.read_text(), "speed") == readme.generated("speed")


def test_the_sweep_table_follows_the_medians():
    report = json.loads((speed.RESULTS / "speed.json").read_text())
    medians, sweep = speed.markdown_tables(report).split("\n\nThe scaling sweep")
    main = {speed.kilo(n) for n in report["lengths"]}
    swept = {speed.kilo(n) for n in report["scaling_lengths"]} - main
    assert main and swept
    for length in main:  # every method's medians at the main lengths, none of them in the sweep
        assert all(f"| {length} | {config} |" in medians for config in speed.CONFIGS)
        assert f"| {length} |" not in sweep
    for length in swept:  # stock and rerope alone at the other lengths
        assert f"| {length} | rerope |" in sweep and f"| {length} | ntk_mixed |" not in sweep
        assert f"| {length} |" not in medians
