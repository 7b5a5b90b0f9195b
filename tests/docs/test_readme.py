"""The documents against the tree and the results: the README's layout names every module
and nothing that is not there, the README stays short, its flags table is the server's, and
bench/README.md's generated blocks are their results files'."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from bench import readme
from rope_plugins.server.config import ServerConfig, flag

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODULE_DIRS = ("rope_plugins", "server", "bench", "deploy", "scripts", "tests")
# blocks whose benchmark has its own test module (test_speed, test_evaluate, ...) are checked there
CHECKED_ELSEWHERE = {"speed", "eval", "eval_quick", "step_budget", "reserved_cores", "base_bound_row"}


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def layout_names(text: str) -> set[str]:
    """The paths the layout names: an indented tree, each line's names (comma-separated, a
    directory ending in /) before two or more spaces and their description."""
    names, parents = set(), []
    for line in section(text, "Layout").splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        depth = (len(line) - len(line.lstrip()) - 4) // 2
        parents = parents[:depth]
        entries = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split(", ")
        names |= {"".join(parents) + entry for entry in entries}
        parents += [entries[-1]] if entries[-1].endswith("/") else []
    return names


def test_the_layout_names_every_module_and_top_level_entry():
    named = layout_names(README.read_text())
    files = tracked()
    top = {path.split("/")[0] + ("/" if "/" in path else "") for path in files if not path.startswith(".")}
    modules = {path for path in files if path.split("/")[0] in MODULE_DIRS and path.endswith((".py", ".sh"))}
    assert sorted((top | modules) - named) == []


def test_the_layout_names_nothing_missing_from_the_tree():
    files = tracked()
    present = set(files) | {path[: i + 1] for path in files for i, c in enumerate(path) if c == "/"}
    assert sorted(layout_names(README.read_text()) - present) == []


README_SECTIONS = ("The two commands", "The playground", "On GPUs", "Models", "A request",
                   "Structured outputs and tool calls", "Under stock `vllm serve`", "Flags", "The methods", "Layout",
                   "Tests", "More")


def test_the_readme_has_its_sections_in_order():
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    assert headings == list(README_SECTIONS)


def test_the_flags_table_is_the_servers():
    rows = dict(re.findall(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", README.read_text(), re.M))
    for name, field in ServerConfig.model_fields.items():
        default = "(none)" if field.default is None else str(field.default)
        assert rows[flag(name)].strip() == (default.lower() if isinstance(field.default, bool) else default)


def test_every_generated_block_has_a_renderer():
    assert sorted(readme.block_names(readme.DOCUMENT.read_text())) == sorted(readme.RENDERERS)


@pytest.mark.parametrize("name", sorted(set(readme.RENDERERS) - CHECKED_ELSEWHERE))
def test_bench_readme_shows_the_committed_results(name):
    """Rerun `bench/readme.py` after a benchmark."""
    assert readme.block(readme.DOCUMENT.read_text(), name) == readme.generated(name)


def test_a_block_is_replaced_and_the_rest_kept(tmp_path):
    begin, end = readme.markers("eval")
    document = tmp_path / "README.md"
    document.write_text(f"# title\n\n{begin}\nold table\n{end}\n\nafter\n")
    for _ in range(2):  # idempotent
        readme.write_block("eval", "| new | table |", document)
        assert document.read_text() == f"# title\n\n{begin}\n| new | table |\n{end}\n\nafter\n"
    assert readme.block_names(document.read_text()) == ["eval"]
    with pytest.raises(SystemExit, match="no"):
        readme.write_block("eval_quick", "x", document)
