"""Shared, session-wide fixtures: an engine takes seconds to start, so each kind starts once."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# Without a GPU the Triton kernels (rope_plugins/ops/gpu.py) run in Triton's interpreter on CPU
# tensors; it is read when a kernel is decorated, so before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.reference_forward import ReferenceModel
from tests.support.tiny_models import LLAMA3_ROPE, TRAIN_LENGTH, make_tiny_model

ENGINE_DEFAULTS = {"method": "rerope", "window": 37}
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


# every test engine on a tiny checkpoint, the plugin's and stock vLLM's alike
TINY_ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
                   kv_cache_memory_bytes=1 << 27, seed=0)


@contextlib.contextmanager
def shut_down_after(llm):
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


# Engines whose core lives in the test's process (by ``id``): they share the process's distributed
# state (a world of one), which vLLM's core tears down when it shuts down.
IN_PROCESS_ENGINES: dict[int, object] = {}
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_in_this_process(**kwargs):
    """``vllm.LLM(**kwargs)`` with its engine core in the test's process, shut down on exit: a
    spawned core costs each start and stop a fresh interpreter that imports vLLM. The variable
    is set only while the engine is built, so servers the tests start later keep vLLM's own
    process layout; the core's freezing of vLLM's environment variables once built is undone, so
    that later tests and engines read them afresh (its freezing of the garbage collector's heap
    it undoes itself when it shuts down); and when it shuts down, the engines still here get
    their distributed state back."""
    from vllm import LLM, envs

    previous = os.environ.get(IN_PROCESS_ENV)
    os.environ[IN_PROCESS_ENV] = "0"
    try:
        llm = LLM(**kwargs)
    finally:
        if previous is None:
            os.environ.pop(IN_PROCESS_ENV)
        else:
            os.environ[IN_PROCESS_ENV] = previous
        envs.disable_envs_cache()
    IN_PROCESS_ENGINES[id(llm)] = llm
    try:
        yield llm
    finally:
        del IN_PROCESS_ENGINES[id(llm)]
        llm.llm_engine.engine_core.shutdown()
        if IN_PROCESS_ENGINES:
            share_a_world_of_one(next(iter(IN_PROCESS_ENGINES.values())))


def share_a_world_of_one(survivor) -> None:
    """The distributed state a single CPU worker sets up (vLLM's ``init_worker_distributed_environment``
    for one process, gloo), again, for the engines still in this process (``survivor``: one of them)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.utils.network_utils import get_distributed_init_method, get_loopback_ip, get_open_port

    with set_current_vllm_config(survivor.llm_engine.vllm_config):
        init_distributed_environment(1, 0, get_distributed_init_method(get_loopback_ip(), get_open_port()), 0, "gloo")
        ensure_model_parallel_initialized(1, 1)


def running_engine(model_dir, defaults=ENGINE_DEFAULTS, in_process=True, **engine):
    """The plugin's engine on ``model_dir`` (the test defaults, overridden by ``engine``; None
    ``defaults``: the checkpoint's own), shut down on exit. One worker runs in the test's
    process unless ``in_process`` is False; several (tensor parallelism) are vLLM's own processes."""
    from vllm import LLM

    from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs

    workers = int(engine.get("tensor_parallel_size", 1))
    compute_on_every_core(workers)
    kwargs = engine_kwargs(str(model_dir), defaults=defaults, max_model_len=MAX_MODEL_LEN,
                           **{**TINY_ENGINE, **engine})
    return engine_in_this_process(**kwargs) if in_process and workers == 1 else shut_down_after(LLM(**kwargs))


def stock_engine(model_dir, **engine):
    """Stock vLLM on ``model_dir`` up to its training length (the test defaults, overridden by
    ``engine``), in the test's process, shut down on exit."""
    return engine_in_this_process(model=str(model_dir), max_model_len=TRAIN_LENGTH, **{**TINY_ENGINE, **engine})


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory):
    """The tiny Llama with a Llama 3.1-style scaled table."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), seed=3, rope=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def llama3(tiny_llama3_dir):
    """The plugin's engine and the oracle on the tiny Llama with a Llama 3.1-style table."""
    with running_engine(tiny_llama3_dir, max_num_batched_tokens=4096, max_num_seqs=16) as llm:
        yield llm, ReferenceModel(tiny_llama3_dir)


@pytest.fixture(scope="session")
def full_engine(tiny_llama_dir):
    """Whole prompts in one step; prefix caching on (vLLM's default)."""
    with running_engine(tiny_llama_dir, max_num_batched_tokens=4096, max_num_seqs=16) as llm:
        yield llm


@pytest.fixture(scope="session")
def chunked_engine(tiny_llama_dir):
    """Prompts prefilled in chunks of 64 tokens, so chunks start inside and past the window."""
    with running_engine(tiny_llama_dir, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True) as llm:
        yield llm


@pytest.fixture(scope="session")
def triton_engine(tiny_llama_dir):
    """The Triton kernels (rope_plugins/ops/gpu.py) in the engine, on CPU tensors under Triton's
    interpreter; prompts in chunks of 128 tokens. In vLLM's own engine process: the interpreter
    runs several times slower in the test's process."""
    with running_engine(tiny_llama_dir, in_process=False, attention_ops="triton", max_num_batched_tokens=128,
                        max_num_seqs=16, enable_chunked_prefill=True) as llm:
        yield llm


@pytest.fixture(scope="session")
def reference_model(tiny_llama_dir):
    return ReferenceModel(tiny_llama_dir)


@pytest.fixture(scope="session")
def engine_defaults():
    from rope_plugins.rules.settings import ExtensionSettings

    return ExtensionSettings(train_length=TRAIN_LENGTH, **ENGINE_DEFAULTS)


# Tests that start an engine or a server process take a minute or more: `-m "not slow"` skips
# them (the unit tests then run in seconds); `make test` runs everything.
ENGINE_FIXTURES = frozenset({"full_engine", "chunked_engine", "reference_model", "tensor_parallel_engine", "server",
                             "llama3", "triton_engine"})
SERVER_MODULES = frozenset({"test_server", "test_server_robustness", "test_plugin_engine", "test_tensor_parallel",
                            "test_v2_runner", "test_playground_browser"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in SERVER_MODULES:
            item.add_marker(pytest.mark.slow)
