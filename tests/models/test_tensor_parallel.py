"""Tensor parallelism on the CPU: two vLLM workers, each with half the heads of the tiny
Llama (4 query / 2 KV heads), serve a batch mixing every method; each request matches the
single-process engine and the oracle. Slow (a second engine with two worker processes)."""

from __future__ import annotations

import pytest

from rope_plugins.frontend.engine_args import cpu_worker_cores
from tests.conftest import running_engine
from tests.frontend.test_engine_args import (
    METHODS,
    PROMPT_LENGTH,
    assert_close_logprobs,
    assert_matches_oracle,
    prompt,
    run,
)


def test_cores_are_split_among_the_workers():
    assert cpu_worker_cores(2, [0, 1]) == "0|1"
    assert cpu_worker_cores(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert cpu_worker_cores(1, [0, 1]) is None and cpu_worker_cores(4, [0, 1]) is None


@pytest.fixture(scope="module")
def tensor_parallel_engine(tiny_llama_dir):
    with running_engine(tiny_llama_dir, max_num_batched_tokens=4096, max_num_seqs=16, tensor_parallel_size=2,
                        distributed_executor_backend="mp") as llm:
        yield llm


@pytest.mark.slow
def test_mixed_settings_batch_on_two_workers_equals_one_process(tensor_parallel_engine, full_engine, reference_model,
                                                                engine_defaults):
    requests = [(prompt(700 + i, PROMPT_LENGTH - 5 * i), fields) for i, fields in enumerate(METHODS)]
    parallel = run(tensor_parallel_engine, requests, engine_defaults)
    single = run(full_engine, requests, engine_defaults)
    for (ours, theirs), (ids, fields) in zip(zip(parallel, single), requests):
        assert_close_logprobs(ours.prompt_logprobs, theirs.prompt_logprobs, f"{fields} on two workers")
        assert ours.tokens == theirs.tokens, fields
        assert_matches_oracle(ours, ids, fields, reference_model, engine_defaults)


def test_the_split_follows_each_engine_and_never_overrides_the_user(monkeypatch):
    from rope_plugins.frontend import engine_args as engine

    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(engine.THREADS_BIND_ENV, raising=False)
    monkeypatch.setattr(engine, "_binding_set_here", None)
    engine.compute_on_every_core(2)
    assert engine.os.environ[engine.THREADS_BIND_ENV] == "0|1"
    engine.compute_on_every_core(1)  # a single-worker engine after it: no stale split
    assert engine.THREADS_BIND_ENV not in engine.os.environ
    monkeypatch.setenv(engine.THREADS_BIND_ENV, "nobind")
    engine.compute_on_every_core(2)
    assert engine.os.environ[engine.THREADS_BIND_ENV] == "nobind"


def test_the_engine_gets_a_bounded_onednn_cache_a_loadable_compile_cache_and_decommitting_tcmalloc_unless_set(
        monkeypatch):
    from rope_plugins.frontend import engine_args as engine

    ours = {engine.ONEDNN_CACHE_ENV: str(engine.ONEDNN_PRIMITIVES_KEPT), engine.AOT_COMPILE_ENV: "0",
            engine.TCMALLOC_DECOMMIT_ENV: "true"}
    for name in ours:
        monkeypatch.delenv(name, raising=False)
    engine.compute_on_every_core()
    assert {name: engine.os.environ[name] for name in ours} == ours
    users = {engine.ONEDNN_CACHE_ENV: "1024", engine.AOT_COMPILE_ENV: "1", engine.TCMALLOC_DECOMMIT_ENV: "false"}
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    engine.compute_on_every_core()
    assert {name: engine.os.environ[name] for name in users} == users
