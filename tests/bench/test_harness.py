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
