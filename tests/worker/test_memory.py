"""rope_plugins/worker/memory.py: the allocator's counts are this process's own, its line reads
back, and the log runs only when asked."""

from __future__ import annotations

import logging
import time

from rope_plugins.worker import memory


def test_the_allocated_count_follows_a_live_allocation():
    before = memory.allocator_counts()
    held = bytearray(64 << 20)  # noqa: F841 (kept alive across the second reading)
    after = memory.allocator_counts()
    assert after["allocated"] - before["allocated"] >= 60 << 20
    assert after["resident"] >= after["allocated"] - (64 << 20)  # untouched pages of a calloc may not be resident


def test_a_line_reads_back_as_it_was_written():
    counts = {"allocated": 3 << 30, "heap": 3 << 30, "resident": 7 << 29}
    line = memory.memory_line(counts, at=1796140000.25)
    assert memory.parse_memory_line(f"16:07:20 WARNING rope_plugins.worker.memory: {line}") == {
        "time": 1796140000.2, "allocated": 3072.0, "heap": 3072.0, "resident": 3584.0}
    assert memory.parse_memory_line("worker memory: nothing measured") is None


def test_the_log_runs_only_when_asked(caplog):
    assert memory.start_memory_log({}) is None
    assert memory.start_memory_log({memory.INTERVAL_VARIABLE: "0"}) is None
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        stop = memory.start_memory_log({memory.INTERVAL_VARIABLE: "0.05"})
        deadline = time.monotonic() + 10
        while not any(memory.parse_memory_line(r.getMessage()) for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.set()
    assert any(memory.parse_memory_line(record.getMessage()) for record in caplog.records)
