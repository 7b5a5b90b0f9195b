"""docs/layout.md's tree against the tree and the imports: it names every module and nothing that
is not there, says for each package folder which processes run it, and the imports keep to it
(no cycle, no folder importing one that runs in fewer processes, nothing serving importing
test support); pyproject.toml installs exactly the package folders."""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
PACKAGE = "rope_plugins"
# the folders installed as the package's subpackages, besides rope_plugins/ itself (pyproject's package-dir)
MAPPED = {"server": f"{PACKAGE}.server", "deploy": f"{PACKAGE}.deploy"}
MODULE_DIRS = ("rope_plugins", "server", "deploy", "bench", "scripts")
# what the layout's brackets say: the serving processes, and the places that are none of them
SERVING = {"every process": {"api", "core", "worker"}, "API server": {"api"}, "workers": {"worker"}}
ELSEWHERE = {"tests, benchmarks", "tests", "benchmarks", "browser", "operator", "build", "readers"}


def tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def layout_lines(text: str = "") -> list[tuple[str, list[str], list[str]]]:
    """(parent path, names, bracketed tags) per line of the layout's indented tree: the names
    (comma-separated, a directory ending in /) come before two or more spaces and their description."""
    text = text or LAYOUT.read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    lines, parents = [], []
    for line in section.splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        depth = (len(line) - len(line.lstrip()) - 4) // 2
        parents = parents[:depth]
        names, *description = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        entries = names.split(", ")
        lines.append(("".join(parents), entries, re.findall(r"\[([^\]]+)\]", "".join(description))))
        parents += [entries[-1]] if entries[-1].endswith("/") else []
    return lines


def layout_names() -> set[str]:
    return {parent + entry for parent, entries, _ in layout_lines() for entry in entries}


def folder_processes() -> dict[str, set[str] | None]:
    """Each folder (or file) the layout tags: the serving processes it runs in, None for elsewhere;
    an untagged entry takes its parent's."""
    tags = {}
    for parent, entries, found in layout_lines():
        for entry in entries:
            path = parent + entry
            if not found:
                continue
            assert all(tag in SERVING or tag in ELSEWHERE for tag in found), (path, found)
            serving = [SERVING[tag] for tag in found if tag in SERVING]
            tags[path.rstrip("/")] = set().union(*serving) if serving else None
    return tags


def module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) > 1 and parts[1] in MAPPED:
        parts = parts[1:]
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == PACKAGE else [PACKAGE, *parts])


def package_files() -> list[Path]:
    return sorted(ROOT / path for path in tracked()
                  if path.endswith(".py") and path.split("/")[0] in (PACKAGE, *MAPPED))


def imports_of(path: Path) -> set[str]:
    """Every module of the package ``path`` imports, at its top or inside a function (not those
    for type checkers only)."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if module_file(name) is not None}


def runtime_nodes(node: ast.AST):
    """``ast.walk`` without the ``if TYPE_CHECKING:`` blocks."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            yield from (grand for orelse in child.orelse for grand in runtime_nodes(orelse))
            continue
        yield from runtime_nodes(child)


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): {module_name(module_file(name)) for name in imports_of(path)} - {module_name(path)}
            for path in package_files()}


def processes_of(path: Path, tags: dict[str, set[str] | None]) -> set[str] | None:
    """The nearest tag above ``path`` (a file's own tag first)."""
    relative = path.relative_to(ROOT)
    for candidate in [relative, *relative.parents]:
        key = str(candidate.with_suffix("") if candidate == relative else candidate)
        for name in (str(candidate), key):
            if name in tags:
                return tags[name]
    raise AssertionError(f"the layout gives no process for {relative}")


def test_the_layout_names_every_module_and_top_level_entry():
    files = tracked()
    top = {path.split("/")[0] + ("/" if "/" in path else "") for path in files if not path.startswith(".")}
    modules = {path for path in files if path.split("/")[0] in MODULE_DIRS and path.endswith((".py", ".sh"))}
    folders = {path.rsplit("/", 1)[0] + "/" for path in files if path.startswith("tests/") and path.count("/") >= 2}
    assert sorted((top | modules | folders) - layout_names()) == []


def test_the_layout_names_nothing_missing_from_the_tree():
    files = tracked()
    present = set(files) | {path[: i + 1] for path in files for i, c in enumerate(path) if c == "/"}
    assert sorted(layout_names() - present) == []


def test_the_layout_says_which_processes_run_every_package_folder():
    tags = folder_processes()
    folders = {path.rsplit("/", 1)[0] for path in tracked()
               if path.endswith(".py") and path.split("/")[0] in (PACKAGE, *MAPPED)}
    assert sorted(folder for folder in folders if folder not in tags) == []


def test_every_test_folder_mirrors_a_folder_of_the_tree():
    package_folders = {path.rsplit("/", 1)[0].split("/")[-1] for path in tracked()
                       if path.split("/")[0] in (PACKAGE, *MAPPED, "bench", "docs") and "/" in path}
    test_folders = {path.split("/")[1] for path in tracked() if path.startswith("tests/") and path.count("/") >= 2}
    assert sorted(test_folders - package_folders - {"support"}) == []


def test_pyproject_installs_the_package_folders_and_not_the_test_support():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(ROOT / path) for path in tracked() if path.endswith("/__init__.py")
               and path.split("/")[0] in (PACKAGE, *MAPPED)}
    assert set(setuptools["packages"]) == folders - {f"{PACKAGE}.testing"}
    assert setuptools["package-dir"] == {package: folder for folder, package in MAPPED.items()}


def test_the_package_has_no_import_cycle():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError naming the cycle


def test_no_folder_imports_one_that_runs_in_fewer_processes():
    tags = folder_processes()
    processes = {module_name(path): processes_of(path, tags) for path in package_files()}
    upward = defaultdict(list)
    for module, imported in import_graph().items():
        if processes[module] is None:  # test support and the load test may import anything
            continue
        for name in imported:
            if processes[name] is None or not processes[module] <= processes[name]:
                upward[module].append(name)
    assert dict(upward) == {}


def test_nothing_imports_the_server_or_deploy_by_their_folder_names():
    bare = re.compile(r"^\s*(from|import) (server|deploy)\b", re.M)
    offenders = [path for path in tracked() if path.endswith(".py") and bare.search((ROOT / path).read_text())]
    assert offenders == []


def seams_table() -> set[str]:
    """The modules the design page's "vLLM seams" table names (``a/b.py``, ``c.py``: c in a's folder)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("\n### The vLLM seams\n", 1)[1].split("\n#", 1)[0]
    named = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        paths = re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0])
        folder = paths[0].rsplit("/", 1)[0]
        named |= {path if "/" in path else f"{folder}/{path}" for path in paths}
    return named


def test_the_design_page_names_every_module_that_imports_vllm():
    uses_vllm = re.compile(r"^\s*(from|import) vllm\b", re.M)
    serving = {str(path.relative_to(ROOT)) for path in package_files()
               if not str(path.relative_to(ROOT)).startswith(f"{PACKAGE}/testing/")}
    importing = {path for path in serving if uses_vllm.search((ROOT / path).read_text())}
    assert sorted(importing ^ seams_table()) == []
