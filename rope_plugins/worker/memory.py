"""The worker's memory as its allocator counts it, logged every ``ROPE_EXTEND_MEMORY_LOG_S``
seconds (unset: never), so that a leak can be told from memory the allocator holds.

Resident memory alone cannot tell them apart: tcmalloc (which the engine's processes preload)
and glibc's malloc keep freed pages and hand them back to the system at their own pace, so a
process's RSS follows the largest work it has done lately, while the bytes its objects hold
(``allocated``) are what a leak grows. ``bench soak`` reads these lines from the server's log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

INTERVAL_VARIABLE = "ROPE_EXTEND_MEMORY_LOG_S"
# tcmalloc's (gperftools') numeric properties, by the name the log line gives each
TCMALLOC_PROPERTIES = {"allocated": "generic.current_allocated_bytes", "heap": "generic.heap_size",
                       "page_heap_free": "tcmalloc.pageheap_free_bytes",
                       "released": "tcmalloc.pageheap_unmapped_bytes"}
LINE = re.compile(r"worker memory at (?P<time>[\d.]+) s: (?P<counts>(?:\w+=[\d.]+ MiB ?)+)")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def tcmalloc_counts(process: ctypes.CDLL) -> dict[str, int] | None:
    """tcmalloc's byte counts where the process has it (preloaded), else None."""
    try:
        read = process.MallocExtension_GetNumericProperty
    except AttributeError:
        return None
    read.argtypes, read.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int
    counts = {}
    for name, prop in TCMALLOC_PROPERTIES.items():
        value = ctypes.c_size_t()
        if read(prop.encode(), ctypes.byref(value)):
            counts[name] = value.value
    return counts


def glibc_counts(process: ctypes.CDLL) -> dict[str, int] | None:
    """glibc malloc's byte counts (``mallinfo2``, glibc 2.33 on), else None."""
    try:
        read = process.mallinfo2
    except AttributeError:
        return None
    read.restype = _MallInfo2
    info = read()
    return {"allocated": info.uordblks + info.hblkhd, "heap": info.arena + info.hblkhd, "page_heap_free": info.fordblks}


def allocator_counts() -> dict[str, int]:
    """The allocator's byte counts (``allocated``: what live objects hold) and the resident bytes."""
    process = ctypes.CDLL(None)
    counts = tcmalloc_counts(process) or glibc_counts(process) or {}
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {**counts, "resident": pages * os.sysconf("SC_PAGE_SIZE")}


def memory_line(counts: dict[str, int], at: float) -> str:
    """The counts at ``at`` (seconds since the epoch: the worker's log lines carry no time)."""
    return f"worker memory at {at:.1f} s: " + " ".join(f"{name}={size / 2**20:.1f} MiB"
                                                      for name, size in counts.items())


def parse_memory_line(line: str) -> dict[str, float] | None:
    """A :func:`memory_line`'s sizes in MiB by name, and its ``time``; None for any other line."""
    match = LINE.search(line)
    if match is None:
        return None
    sizes = {name: float(size) for name, size in re.findall(r"(\w+)=([\d.]+) MiB", match["counts"])}
    return {"time": float(match["time"]), **sizes}


def start_memory_log(environ: os._Environ | dict[str, str] = os.environ) -> threading.Event | None:
    """A daemon thread logging :func:`memory_line` every ``ROPE_EXTEND_MEMORY_LOG_S`` seconds
    until the event returned is set (None: not asked)."""
    every = float(environ.get(INTERVAL_VARIABLE) or 0)
    if every <= 0:
        return None
    stop = threading.Event()

    def log_memory() -> None:
        while not stop.wait(every):
            logger.warning(memory_line(allocator_counts(), time.time()))

    threading.Thread(target=log_memory, name="memory-log", daemon=True).start()
    return stop
