"""``python -m rope_plugins.server.supervisor [flags]``: the server (``python -m
rope_plugins.server [flags]``), started again when it exits on its own; ``make run`` runs this.

The server does not restart a dead engine in-process: a fresh process is the only state known
to be clean after an engine died mid-step, so it exits with status 3 and leaves the restart to
a supervisor (compose's and Kubernetes' restart policies in a deployment; this one for ``make
run``). Each restart writes one log line saying why, and waits a back-off that doubles from
:data:`FIRST_DELAY` up to :data:`LONGEST_DELAY`, and starts over once a run has lasted
:data:`STEADY_SECONDS`. The new server binds the same port. A server whose engine fails
:data:`START_FAILURES` times in a row before it ever served (a bad checkpoint, too little
memory) is not started again: that needs a person. SIGINT and SIGTERM are passed to the
server, and the supervisor exits with its status once it has stopped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("rope_plugins.server.supervisor")

# where the server writes why it exited (server/__main__.py): {"reason": ..., "served": bool}
EXIT_REPORT_ENV = "ROPE_EXTEND_EXIT_REPORT"
FIRST_DELAY = 1.0
LONGEST_DELAY = 30.0
STEADY_SECONDS = 300.0
START_FAILURES = 3
USAGE_ERROR = 2  # argparse's status for bad flags: starting again cannot help


@dataclass(frozen=True)
class Exit:
    """How one run of the server ended."""

    status: int  # negative: killed by that signal
    seconds: float
    reason: str = ""
    served: bool = True  # whether its engine had become ready


def describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def read_report(path: Path) -> tuple[str, bool]:
    """The server's own account of its exit; none (a crash, a kill) says nothing."""
    try:
        report = json.loads(path.read_text())
        return str(report.get("reason", "")), bool(report.get("served", True))
    except (OSError, ValueError, AttributeError):
        return "", True


class Backoff:
    """The wait before each restart: doubling up to a bound, reset by a steady run; and whether
    to restart at all."""

    def __init__(self) -> None:
        self.delay, self.start_failures = FIRST_DELAY, 0

    def next(self, ended: Exit) -> float | None:
        """Seconds to wait before starting again, or None to stop."""
        if ended.status in (0, USAGE_ERROR):
            return None
        self.start_failures = 0 if ended.served else self.start_failures + 1
        if self.start_failures >= START_FAILURES:
            return None
        if ended.seconds >= STEADY_SECONDS:
            self.delay = FIRST_DELAY
        delay, self.delay = self.delay, min(self.delay * 2, LONGEST_DELAY)
        return delay


class Supervisor:
    def __init__(self, argv: list[str]) -> None:
        self.argv, self.child, self.stopping = argv, None, False
        self.report = Path(tempfile.mkstemp(prefix="rope-extend-exit-", suffix=".json")[1])

    def forward(self, signum: int, _frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or less if told to stop; whether told to stop."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.stopping

    def run_once(self) -> Exit:
        self.report.write_text("")
        began = time.monotonic()
        self.child = subprocess.Popen([sys.executable, "-m", "rope_plugins.server", *self.argv],
                                      env={**os.environ, EXIT_REPORT_ENV: str(self.report)})
        status = self.child.wait()
        return Exit(status, time.monotonic() - began, *read_report(self.report))

    def run(self) -> int:
        backoff, restarts = Backoff(), 0
        try:
            while True:
                ended = self.run_once()
                delay = None if self.stopping else backoff.next(ended)
                if delay is None:
                    if not self.stopping and ended.status not in (0, USAGE_ERROR):
                        logger.error("the server %s%s before it ever served, %d times in a row; not "
                                     "starting it again", describe(ended.status), because(ended), START_FAILURES)
                    return ended.status if ended.status >= 0 else 128 - ended.status
                restarts += 1
                logger.warning("the server %s after %.0f s%s; starting it again in %.0f s (restart %d)",
                               describe(ended.status), ended.seconds, because(ended), delay, restarts)
                if self.wait(delay):
                    return 0
        finally:
            self.report.unlink(missing_ok=True)


def because(ended: Exit) -> str:
    return f" ({ended.reason})" if ended.reason else ""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    supervisor = Supervisor(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, supervisor.forward)
    signal.signal(signal.SIGTERM, supervisor.forward)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
