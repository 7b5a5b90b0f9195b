"""The step-budget comparison's report (its runs are load tests against real servers: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import step_budget  # noqa: E402


def test_the_readme_table_is_the_committed_results():
    runs = json.loads((step_budget.RESULTS / "step_budget.json").read_text())["runs"]
    assert step_budget.table(runs) in (ROOT / "README.md").read_text()


def test_runs_are_labelled_by_what_varies():
    runs = [{"budget": 2048, "reserved_cores": 0}, {"budget": 2048, "reserved_cores": 1}]
    assert [step_budget.run_label(r, runs) for r in runs] == ["2,048, 0 reserved", "2,048, 1 reserved"]
    assert step_budget.run_label(runs[0], runs[:1]) == "2,048"
