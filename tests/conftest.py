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


def running_engine(model_dir, defaults=ENGINE_DEFAULTS, **engine):
    """The plugin's engine on ``model_dir`` (the test defaults, overridden by ``engine``; None
    ``defaults``: the checkpoint's own), shut down on exit."""
    from vllm import LLM

    from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs

    compute_on_every_core(int(engine.get("tensor_parallel_size", 1)))
    kwargs = engine_kwargs(str(model_dir), defaults=defaults, max_model_len=MAX_MODEL_LEN,
                           **{**TINY_ENGINE, **engine})
    return shut_down_after(LLM(**kwargs))


def stock_engine(model_dir, **engine):
    """Stock vLLM on ``model_dir`` up to its training length (the test defaults, overridden by
    ``engine``), shut down on exit."""
    from vllm import LLM

    return shut_down_after(LLM(model=str(model_dir), max_model_len=TRAIN_LENGTH, **{**TINY_ENGINE, **engine}))


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
    interpreter; prompts in chunks of 128 tokens."""
    with running_engine(tiny_llama_dir, attention_ops="triton", max_num_batched_tokens=128, max_num_seqs=16,
                        enable_chunked_prefill=True) as llm:
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
                            "test_v2_runner", "test_playground_browser", "test_slow_clients"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in SERVER_MODULES:
            item.add_marker(pytest.mark.slow)
