"""No function over 60 lines (issue 34): the Python functions under rope_plugins/, server/,
deploy/, bench/ and scripts/ (from `ast`: the def line to its last line) and the C++ functions
under rope_plugins/ops/csrc/ (a brace-matching scan: the first line of the declaration to the
closing brace). Prints each offender as `path:line name (N lines)` and exits 1 if there is one.

    .venv/bin/python scripts/function_lengths.py [--max 60] [PATH ...]

PATH (a file or a folder) replaces the default tree; pre-commit runs it with none
(.pre-commit-config.yaml) and so does tests/docs/test_lint.py.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("rope_plugins", "server", "deploy", "bench", "scripts")  # the C++ is in rope_plugins/ops/csrc
CPP_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")
SKIPPED_DIRS = {"__pycache__", "results", "build"}  # bench/results holds data, not code
MAX_LINES = 60

# A function's length: (first line, name, lines).
Length = tuple[int, str, int]


def python_functions(source: str) -> Iterator[Length]:
    """Every def (methods and nested functions too), named like a qualname: Class.method, outer.inner."""

    def visit(node: ast.AST, prefix: str) -> Iterator[Length]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child.lineno, prefix + child.name, child.end_lineno - child.lineno + 1
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(source), "")


CPP_TOKEN = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.S)
PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)  # with its continued lines


def blanked(match: re.Match) -> str:
    """The match as spaces, its newlines kept (offsets still give line numbers); a string or
    character literal keeps its quotes."""
    text = match.group()
    spaces = re.sub(r"[^\n]", " ", text)
    return text[0] + spaces[1:-1] + text[-1] if text[0] in "\"'" else spaces


def strip_cpp(source: str) -> str:
    """The source with comments, literals' contents and preprocessor lines blanked out."""
    return PREPROCESSOR.sub(blanked, CPP_TOKEN.sub(blanked, source))


CONTROL = {"if", "for", "while", "switch", "catch"}
SCOPE = re.compile(r"\b(namespace|extern|class|struct|union)\b")
ATTRIBUTE = re.compile(r"\[\[.*?\]\]|\b(__attribute__|alignas|__declspec)\s*\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")


def without_angles(header: str) -> str:
    """The header without `template <...>` parameter lists, attributes and alignas(...)."""
    header = ATTRIBUTE.sub(" ", header)
    while (match := re.search(r"\btemplate\s*<", header)) is not None:
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(header)):
            depth += {"<": 1, ">": -1}.get(header[end], 0)
            if depth == 0:
                break
        header = header[: match.start()] + " " + header[end + 1 :]
    return header


def block_kind(header: str) -> tuple[str, str]:
    """What a `{` opens, from the text before it since the last `;`, `{` or `}`: ("function",
    name) when a name and parentheses come before it, ("scope", "") for a namespace, an
    `extern "C"` block or a class, whose members are scanned, or ("other", "")."""
    header = without_angles(header).strip()
    paren = header.find("(")
    if paren < 0:
        return ("scope", "") if SCOPE.search(header) else ("other", "")  # other: an initialiser
    if "=" in header[:paren]:
        return "other", ""  # a lambda stored in a variable
    # the name, with a specialisation's template arguments (micro_gemm<8>) or an operator's symbol
    name = re.search(r"(~?[A-Za-z_][\w:]*(?:<[^<>()]*>)?(?:\s*operator\s*\S+)?)\s*$", header[:paren])
    if name is None or name.group(1) in CONTROL:
        return "other", ""
    return "function", name.group(1)


def cpp_functions(source: str) -> Iterator[Length]:
    """The bodies of functions at namespace or class scope (a lambda or a block inside a
    function counts towards that function)."""
    text = strip_cpp(source)

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    stack: list[tuple[str, str, int]] = []  # (kind, name, offset of the declaration's start)
    start = 0  # where the text before the next `{` begins
    for offset, char in enumerate(text):
        if char == "{":
            header = text[start:offset]
            begin = start + len(header) - len(header.lstrip())
            if all(kind == "scope" for kind, _, _ in stack):
                stack.append((*block_kind(header), begin))
            else:
                stack.append(("inner", "", begin))
            start = offset + 1
        elif char == "}":
            if stack:
                kind, name, begin = stack.pop()
                if kind == "function":
                    yield line_of(begin), name, line_of(offset) - line_of(begin) + 1
            start = offset + 1
        elif char == ";":
            start = offset + 1


def source_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_file():
            yield path
            continue
        for file in sorted(path.rglob("*")):
            parts = set(file.relative_to(path).parts[:-1])
            if file.is_file() and not parts & SKIPPED_DIRS and not any(p.startswith(".") for p in parts):
                yield file


def lengths(file: Path) -> Iterator[Length]:
    if file.suffix == ".py":
        yield from python_functions(file.read_text())
    elif file.suffix in CPP_SUFFIXES:
        yield from cpp_functions(file.read_text())


def offenders(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    found = []
    for file in source_files(paths):
        shown = file.resolve().relative_to(ROOT) if file.resolve().is_relative_to(ROOT) else file
        found += [f"{shown}:{line} {name} ({count} lines)" for line, name, count in lengths(file) if count > limit]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="files or folders (default: the project's code)")
    parser.add_argument("--max", type=int, default=MAX_LINES, help="the most lines a function may have")
    args = parser.parse_args(argv)
    found = offenders(args.paths or [ROOT / name for name in CODE_DIRS], args.max)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
