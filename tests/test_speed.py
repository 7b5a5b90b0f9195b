"""The speed comparison's report (its runs start two real engines for half an hour: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import speed  # noqa: E402


def test_the_readme_tables_are_the_committed_results():
    """Rerun `bench/speed.py --markdown` into the README after a speed run."""
    report = json.loads((speed.RESULTS / "speed.json").read_text())
    readme = (ROOT / "README.md").read_text()
    tables = speed.markdown_tables(report).split("\n\n")  # the medians, then the scaling sweep
    assert len(tables) == 2 and all(table in readme for table in tables)
