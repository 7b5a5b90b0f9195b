"""bench's one entry and its shared harness: every suite is a module with main(argv), the entry
lists them and refuses an unknown one, and a report starts with the same header everywhere."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from bench import __main__ as entry
from bench import harness

BENCH = Path(entry.__file__).parent


def test_every_suite_is_a_module_whose_main_takes_argv():
    for name, (module, what) in entry.SUITES.items():
        tree = ast.parse((BENCH / f"{module}.py").read_text())
        [main] = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
        assert [arg.arg for arg in main.args.args] == ["argv"], name
        assert what


def test_the_entry_lists_the_suites_and_refuses_an_unknown_one(capsys):
    assert entry.main([]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in entry.SUITES)
    assert entry.main(["no-such-suite"]) == 2
    assert "usage" in capsys.readouterr().err


def test_a_report_starts_with_the_shared_header_and_is_written_as_json(tmp_path):
    report = harness.header(model="m")
    assert list(report)[:3] == ["date", "machine", "commit"] and report["model"] == "m"
    assert "cores" in report["machine"] and report["date"].endswith("+00:00")
    path = harness.write_json(report, tmp_path / "deep" / "r.json")
    assert json.loads(path.read_text()) == report


def test_the_expected_time_is_the_latest_three_of_the_same_key_else_the_others_median():
    done = [("a", 400.0), ("a", 150.0), ("a", 170.0), ("a", 160.0), ("b", 30.0)]
    assert harness.expected_seconds(["a", "b", "c"], done) == [160.0, 30.0, 95.0]
    assert harness.expected_seconds(["c"], []) == [60.0]


def test_the_grid_measures_in_turn_and_stops_before_what_does_not_fit_the_budget(capsys):
    measured = []
    harness.run_grid([1, 2, 3], [0.0, 0.0, 3600.0], measured.append, str, "test", budget_minutes=1)
    assert measured == [1, 2]
    assert "does not fit in the budget" in capsys.readouterr().err


def test_a_markdown_table_shows_none_as_a_dash():
    assert harness.markdown_table(["a", "b"], [[1, None]]) == "| a | b |\n| --- | --- |\n| 1 | - |"


def test_bench_stays_light_to_carry():
    """Issue 53's bounds: bench's Python at most 3,000 lines, its README at most 20 KB (mostly generated blocks)."""
    lines = sum(len(path.read_text().splitlines()) for path in BENCH.glob("*.py"))
    assert lines <= 3000, f"bench/*.py holds {lines:,} lines"
    assert len((BENCH / "README.md").read_bytes()) <= 20_000
