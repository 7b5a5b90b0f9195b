"""The documents against the code and the results: the README's sections in order, its size, its
flags table the server's --help, every docs page linked from it, and bench/README.md's generated
blocks their results files' (the layout: test_layout.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench import readme
from scripts import readme_flags

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# blocks whose benchmark has its own test module (test_speed, test_quality, ...) are checked there
CHECKED_ELSEWHERE = {"speed", "eval", "eval_digits", "eval_new_methods", "step_budget", "reserved_cores"}


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


README_SECTIONS = ("The two commands", "A request", "Structured outputs and tool calls", "The methods", "Flags",
                   "Where to go next")


def test_the_readme_has_its_sections_in_order_and_fits_two_screens():
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    assert headings == list(README_SECTIONS)
    assert len(README.read_bytes()) <= 10_000


def test_the_flags_table_is_the_servers_help():
    text = README.read_text()
    assert readme_flags.with_table(text) == text, "run scripts/readme_flags.py"
    rows = re.findall(r"^\| `(--[a-z-]+)` \|", text, re.M)
    assert len(rows) == len(set(rows)) > 30


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text()))
    pages = {path for path in tracked() if path.startswith("docs/") and path.endswith(".md")}
    assert pages and pages <= linked, f"not linked from the README: {sorted(pages - linked)}"


def test_every_generated_block_has_a_renderer():
    assert sorted(name for document in readme.DOCUMENTS for name in readme.block_names(document.read_text())) == sorted(
        readme.RENDERERS)


@pytest.mark.parametrize("name", sorted(set(readme.RENDERERS) - CHECKED_ELSEWHERE))
def test_bench_readme_shows_the_committed_results(name):
    """Rerun `python -m bench readme` after a benchmark."""
    assert readme.shown(name) == readme.generated(name)


def test_a_block_is_replaced_and_the_rest_kept(tmp_path):
    begin, end = readme.markers("eval")
    document = tmp_path / "README.md"
    document.write_text(f"# title\n\n{begin}\nold table\n{end}\n\nafter\n")
    for _ in range(2):  # idempotent
        readme.write_block("eval", "| new | table |", document)
        assert document.read_text() == f"# title\n\n{begin}\n| new | table |\n{end}\n\nafter\n"
    assert readme.block_names(document.read_text()) == ["eval"]
    with pytest.raises(SystemExit, match="no"):
        readme.write_block("eval_digits", "x", document)
