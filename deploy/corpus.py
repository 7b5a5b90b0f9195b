"""Long real text for the evaluation and the load test, written by no one here and present on
every machine that runs Python: CPython's own documentation (the ``pydoc_data`` topics, the
prose of the language reference) or its standard-library sources.

``load_corpus("pydoc" | "stdlib" | PATH)``: a path may be a text file or a directory (its
``*.txt``, ``*.md``, ``*.rst`` and ``*.py`` files, in name order).
"""

from __future__ import annotations

import sys
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


def documentation_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def stdlib_source_text() -> str:
    library = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return "\n\n".join(path.read_text(errors="replace") for path in sorted(library.glob("*.py")))


def load_corpus(spec: str = "pydoc") -> str:
    if spec == "pydoc":
        return documentation_text()
    if spec == "stdlib":
        return stdlib_source_text()
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
        return "\n\n".join(p.read_text(errors="replace") for p in files)
    return path.read_text(errors="replace")
