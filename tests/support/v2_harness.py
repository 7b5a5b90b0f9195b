"""Test harness, never product code: the plugin's engine on vLLM's V2 model runner, on this CPU.

vLLM runs V2 wherever Triton works (GPUs); the CPU build runs V1 because its Triton has no
``cpu`` backend. Here V2 is forced: ``VLLM_USE_V2_MODEL_RUNNER=1``; Triton's interpreter
(``TRITON_INTERPRET=1``, read when a kernel is decorated) runs V2's own kernels on CPU
tensors; and a ``cpu`` entry in Triton's backends makes vLLM believe Triton is usable, which
vLLM decides once, when ``vllm.triton_utils`` is first imported
(``vllm/triton_utils/importing.py``). All of it must hold before vLLM is imported and must
reach no other test of the session, so the engine lives in a child process started afresh
for it, its engine core in that process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a process
vLLM spawned would start without the shim). :class:`RemoteLLM` talks to it over a pipe:
its ``generate`` is ``LLM.generate``, so the helpers of ``test_plugin_engine`` take it as an
engine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

V2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
START_SECONDS = 600  # engine start-up under the interpreter, with margin on a busy 2-core machine
POLL_SECONDS = 2


def believe_triton_usable() -> None:
    """Register a ``cpu`` entry in Triton's backends: vLLM's CPU build then takes Triton as
    usable. Nothing compiles through it; the interpreter runs every kernel."""
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=DriverBase))


class RemoteLLM:
    """The engine in the child process, answering ``generate`` as ``vllm.LLM`` does (its
    exceptions re-raised here). ``facts`` says what the child saw: which model runner and model
    state the engine built."""

    def __init__(self, connection: Connection, child: subprocess.Popen) -> None:
        self.connection, self.child = connection, child
        self.facts: dict[str, Any] = self._receive(START_SECONDS)

    def _receive(self, seconds: float | None = None) -> Any:
        waited = 0.0
        while not self.connection.poll(POLL_SECONDS):
            waited += POLL_SECONDS
            if self.child.poll() is not None:
                raise RuntimeError(f"the V2 engine process exited with {self.child.returncode} (its log is above)")
            if seconds is not None and waited >= seconds:
                raise TimeoutError(f"the V2 engine process gave no answer in {seconds} s")
        answered, value = self.connection.recv()
        if not answered:
            raise value
        return value

    def generate(self, prompts, params, use_tqdm: bool = False):
        self.connection.send((prompts, params))
        return self._receive()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.send(None)
        try:
            self.child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        self.connection.close()


@contextlib.contextmanager
def v2_engine(model_dir, **engine):
    """``conftest.running_engine(model_dir, **engine)`` on the V2 runner, in a child process."""
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-m", __spec__.name, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                             env={**os.environ, **V2_ENV}, stdin=subprocess.DEVNULL,
                             cwd=Path(__file__).resolve().parents[2])
    theirs.close()
    connection = Connection(ours.detach())
    connection.send((str(model_dir), engine))
    llm = None
    try:
        llm = RemoteLLM(connection, child)
        yield llm
    finally:
        if llm is not None:
            llm.close()
        else:
            child.kill()
            child.wait()
            connection.close()


DUMMY_RUN_TOKENS = 24


def engine_facts(llm) -> dict[str, Any]:
    """Which runner and model state the in-process engine built, and whether a dummy step with
    attention (as a GPU worker's warm-up and graph capture run; this CPU's profiling skips
    attention) builds the plugin's metadata: its rows name slots 0..n-1 that no request holds."""
    def worker_facts(worker) -> dict[str, Any]:
        runner = worker.model_runner
        state = getattr(runner, "model_state", None)
        try:
            runner._dummy_run(DUMMY_RUN_TOKENS)
            dummy_run = None
        except Exception as error:
            dummy_run = repr(error)
        return {"runner": f"{type(runner).__module__}.{type(runner).__name__}",
                "model_state": type(state).__name__ if state is not None else None, "dummy_run_error": dummy_run,
                "kv_cache_groups": len(runner.kv_cache_config.kv_cache_groups)}

    [facts] = llm.collective_rpc(worker_facts)
    return {**facts, "use_v2_model_runner": llm.llm_engine.vllm_config.use_v2_model_runner}


def serve(connection: Connection) -> None:
    """The child: start the engine, then answer each ``(prompts, params)`` until ``None``."""
    model_dir, engine = connection.recv()
    from tests.conftest import running_engine

    try:
        context = running_engine(model_dir, **engine)
        llm = context.__enter__()
    except BaseException as error:
        connection.send((False, RuntimeError(f"the V2 engine did not start: {error!r}")))
        raise
    try:
        connection.send((True, engine_facts(llm)))
        while (request := connection.recv()) is not None:
            prompts, params = request
            try:
                connection.send((True, llm.generate(prompts, params, use_tqdm=False)))
            except Exception as error:  # the request's failure, for the test to see
                connection.send((False, error))
    finally:
        context.__exit__(None, None, None)


if __name__ == "__main__":
    believe_triton_usable()  # before anything imports vLLM
    serve(Connection(int(sys.argv[1])))
