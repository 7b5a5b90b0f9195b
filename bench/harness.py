"""What every benchmark shares: the report's header (date, machine, commit), its JSON file,
the plot backend, Markdown tables, a server to measure, and the resumable grid (a results log
of JSON lines, a progress bar of expected seconds, a time budget). A benchmark is a module with
``main(argv)``; ``python -m bench`` names them."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def now() -> str:
    """The time a report is written: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine() -> str:
    """This machine in one line: its CPU's model (as /proc/cpuinfo names it), architecture, cores,
    and widest vector and matrix instructions."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    isa = "avx512f" if " avx512f" in info else "avx2" if " avx2" in info else platform.machine()
    amx = ", amx" if " amx_tile" in info else ""
    return f"{model} ({platform.machine()}), {os.cpu_count()} cores, {isa}{amx}"


def gpu_versions(device) -> dict:
    """What ran on ``device`` (a torch device): the GPU, CUDA, Triton and torch, and this machine."""
    import torch
    import triton

    cuda = device.type == "cuda"
    return {"gpu": torch.cuda.get_device_name(device) if cuda else None,
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0, "cuda": torch.version.cuda,
            "triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": machine(), "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1"}


def commit() -> str | None:
    """The checkout's commit, with ``+`` where the work tree differs from it (None outside git)."""
    try:  # no tag matches --exclude '*': the abbreviated commit, "+" for changes to tracked files
        return subprocess.run(["git", "describe", "--always", "--dirty=+", "--exclude=*"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


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


def add_attention_precision(parser, help: str | None = None) -> None:
    """The suites' ``--attention-precision``: the plugin's, defaulting to what the server serves."""
    from rope_plugins.plugin import ATTENTION_PRECISIONS, DEFAULT_ATTENTION_PRECISION

    parser.add_argument("--attention-precision", choices=ATTENTION_PRECISIONS, default=DEFAULT_ATTENTION_PRECISION,
                        help=help)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; numbers as they are given (format them first), None as "-"."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("-" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def served_model(base: str, api_key: str | None = None) -> str:
    """The id of the one model a server at ``base`` serves."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{base}/v1/models", headers=headers, timeout=60).raise_for_status().json()["data"][0]["id"]


@contextlib.contextmanager
def server_at(url: str | None, flags: list[str], log: Path) -> Iterator[str]:
    """``url`` when a suite is pointed at a running server, else the base of one started with
    ``flags`` (its log at ``log``) and stopped after."""
    if url:
        yield url.rstrip("/")
        return
    from rope_plugins.testing.launcher import running_server

    with running_server(flags, log) as server:
        yield server.base


def read_log(path: Path) -> list[dict]:
    """A results log: one JSON record per line, appended as each measurement ends."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_log(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def run_grid(jobs: list[Any], expected: list[float], measure: Callable[[Any], None], name: Callable[[Any], str],
             desc: str, budget_minutes: float | None = None) -> None:
    """Measure ``jobs`` in turn (``measure`` appends each one's record to its log) under a progress
    bar of ``expected`` seconds (measurements differ by orders of magnitude: only seconds make
    the remaining time mean something), stopping before a job whose expected time, at this run's
    pace, would end past ``budget_minutes``. Ctrl-C and SIGTERM stop it between records: a rerun
    resumes."""
    from tqdm import tqdm

    previous = {stop: signal.signal(stop, signal.default_int_handler)  # a job runner's kill ends it as Ctrl-C does
                for stop in (signal.SIGINT, signal.SIGTERM)}
    began, estimated = time.perf_counter(), 0.0
    deadline = began + 60 * budget_minutes if budget_minutes is not None else math.inf
    print(f"{len(jobs)} to do, about {sum(expected) / 3600:.1f} h at the pace of the log's earlier ones",
          file=sys.stderr)
    with tqdm(total=round(sum(expected)), desc=desc, unit="s", unit_scale=True,
              bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}") as bar:
        try:
            for number, (job, seconds) in enumerate(zip(jobs, expected), start=1):
                pace = (time.perf_counter() - began) / estimated if estimated else 1.0
                if time.perf_counter() + seconds * pace > deadline:
                    bar.write(f"the next one ({name(job)}, about {seconds:.0f} s) does not fit in the budget: "
                              "stopping (rerun to resume)", file=sys.stderr)
                    break
                bar.set_postfix_str(f"{number}/{len(jobs)}: {name(job)}")
                measure(job)
                estimated += seconds
                bar.update(round(seconds))
        except KeyboardInterrupt:
            bar.write("interrupted: the summary covers what finished (rerun to resume)", file=sys.stderr)
        finally:
            for stop, handler in previous.items():
                signal.signal(stop, handler)


def expected_seconds(keys: list[Any], done: list[tuple[Any, float]], default: float = 60.0) -> list[float]:
    """Each job's expected time from the log (``done``: (key, seconds) of its records): the median
    of the latest three with the same key; else the median of the others' estimates, else ``default``."""
    times: dict[Any, list[float]] = {}
    for key, seconds in done:
        times.setdefault(key, []).append(seconds)
    known = [statistics.median(times[key][-3:]) if key in times else None for key in keys]
    guess = statistics.median([s for s in known if s is not None] or [default])
    return [guess if s is None else s for s in known]
