"""Start a server process and wait until it serves: for the evaluation, the load test's
users and the tests (``with running_server(["--max-model-len", "4096"]) as url: ...``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    base: str
    process: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 90) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_server(flags: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 900,
                 supervised: bool = False) -> ServerProcess:
    """``python -m rope_plugins.server`` on a free loopback port with ``flags`` (under ``make
    run``'s supervisor where ``supervised``); returns once /health is 200."""
    port = free_port()
    module = "rope_plugins.server.supervisor" if supervised else "rope_plugins.server"
    command = [sys.executable, "-m", module, "--port", str(port), *flags]
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=output,
                                   stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_healthy(server, timeout)
    except RuntimeError:
        server.stop()
        raise
    return server


def wait_healthy(server: ServerProcess, timeout: float) -> None:
    """Return once ``server``'s /health answers 200; raise RuntimeError if its process exits or
    ``timeout`` seconds pass first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited early (code {server.process.returncode}):\n"
                               f"{server.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s:\n{server.log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_server(flags: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = start_server(flags, log, env)
    try:
        yield server
    finally:
        server.stop()
