"""What every benchmark shares: the report's header (date, machine, commit), its JSON file,
and the plot backend. A benchmark is a module with ``main(argv)``; ``python -m bench`` names them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def now() -> str:
    """The time a report is written: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """This machine in one line: its CPU, architecture, cores, and widest vector and matrix instructions."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "avx512f" if " avx512f" in info else "avx2" if " avx2" in info else platform.machine()
    amx = ", amx" if " amx_tile" in info else ""
    return f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} cores, {isa}{amx}"


def commit() -> str | None:
    """The checkout's commit, with ``+`` where the work tree differs from it (None outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def header(**fields: Any) -> dict[str, Any]:
    """The fields every report starts with, then the benchmark's own."""
    return {"date": now(), "machine": machine(), "commit": commit(), **fields}


def write_json(report: Any, path: Path, **options: Any) -> Path:
    """A report as indented JSON, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, **options) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the file backend: the plots are PNGs, on machines with no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
