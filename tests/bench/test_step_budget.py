"""The step-budget comparison's report (its runs are load tests against real servers: a
benchmark, run by hand; bench/results holds the last one)."""

from __future__ import annotations

import json

import pytest

from bench import readme, step_budget
from rope_plugins.server.config import ServerConfig


@pytest.mark.parametrize("name", ["step_budget", "reserved_cores"])
def test_bench_readme_shows_the_committed_results(name):
    assert readme.shown(name) == readme.generated(name)


def test_the_server_default_is_the_budget_the_measurements_pick():
    runs = json.loads((step_budget.RESULTS / "step_budget.json").read_text())["runs"]
    assert step_budget.chosen_budget(runs)["budget"] == ServerConfig().max_num_batched_tokens


def test_runs_are_labelled_by_what_varies():
    runs = [{"budget": 2048, "reserved_cores": 0}, {"budget": 2048, "reserved_cores": 1}]
    assert [step_budget.run_label(r, runs) for r in runs] == ["2,048, 0 reserved", "2,048, 1 reserved"]
    assert step_budget.run_label(runs[0], runs[:1]) == "2,048"
