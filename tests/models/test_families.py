"""Every served family through the real engine (rope_plugins/models/families.py): the stock vLLM model
with rotation moved into the plugin's attention, on a tiny random checkpoint of each real
architecture. ``none`` equals stock vLLM on the same checkpoint; every method, mixed in one
batch and prefilled in chunks, equals transformers' model of that family running the oracle.
Llama's engine cases are the suite's own tiny Llama's (tests/frontend/test_engine_args.py: ``none``
against stock vLLM, every method alone and mixed, and prefilled in chunks, against the oracle)."""

from __future__ import annotations

import pytest
import torch

from tests.frontend.test_engine_args import (
    PROMPT_LENGTH,
    assert_close_logprobs,
    assert_matches_oracle,
    assert_none_equals_stock,
    prompt,
    run,
)
from tests.support.tiny_models import TRAIN_LENGTH, make_tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
ENGINE_FAMILIES = FAMILIES[1:]  # llama's engines are test_engine_args': two engine starts fewer
MIXED = [{"method": "none"}, {"method": "rerope", "window": 37}, {"method": "leaky_rerope", "window": 50},
         {"method": "ntk_mixed", "factor": 4.0, "log_n": True}, {"method": "yarn", "factor": 4.0},
         {"method": "pi", "factor": 2.0}, {"method": "ntk_old", "factor": 4.0}, {"method": "ntk_fixed", "factor": 3.0},
         {"method": "self_extend", "window": 40, "group": 4}, {"method": "ntk_dynamic"},
         {"method": "string", "shift": 90, "local": 10},
         {"method": "dual_chunk", "chunk_size": 138, "local_window": 10}]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_oracle_with_none_is_transformers_own_model(name, tmp_path):
    """The reference forward (rotation off on full-attention layers, the oracle there; Gemma 3's
    local layers as transformers has them) under ``none`` is the family's own model."""
    from transformers import AutoModelForCausalLM

    from rope_plugins.rules.settings import ExtensionSettings
    from tests.support.reference_forward import ReferenceModel

    directory = make_tiny_model(tmp_path, name, seed=11)
    ids = prompt(7, 150)
    ours = ReferenceModel(directory).logits(ids, ExtensionSettings(train_length=TRAIN_LENGTH)).log_softmax(-1)
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = stock(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-5)


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def family(request, tmp_path_factory, engine_defaults):
    """One family at a time: its checkpoint, the plugin's engine (prompts prefilled in chunks of
    64 tokens), stock vLLM's engine and the oracle."""
    from tests.conftest import running_engine, stock_engine
    from tests.support.reference_forward import ReferenceModel

    directory = make_tiny_model(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param, seed=11)
    with running_engine(directory, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True) as plugin, \
            stock_engine(directory) as stock:
        yield {"name": request.param, "plugin": plugin, "stock": stock, "reference": ReferenceModel(directory),
               "defaults": engine_defaults}


@pytest.mark.slow
def test_none_equals_stock_vllm(family):
    requests = [(prompt(40 + i, 150 + 23 * i), {"method": "none"}) for i in range(3)]
    assert_none_equals_stock(family["plugin"], family["stock"], requests, family["defaults"], family["name"])


@pytest.mark.slow
def test_every_method_mixed_and_chunked_matches_the_oracle_and_alone(family):
    """Every method in one batch against the oracle; then each alone, which answers as in the batch."""
    requests = [(prompt(60 + i, PROMPT_LENGTH - 11 * i), fields) for i, fields in enumerate(MIXED)]
    mixed = run(family["plugin"], requests, family["defaults"])
    for result, (ids, fields) in zip(mixed, requests):
        assert_matches_oracle(result, ids, fields, family["reference"], family["defaults"])
    for in_batch, request in zip(mixed, requests):
        [alone] = run(family["plugin"], [request], family["defaults"])
        assert_close_logprobs(alone.prompt_logprobs, in_batch.prompt_logprobs, f"{request[1]} alone")
        assert alone.tokens == in_batch.tokens, request[1]


# Qwen2.5-7B-Instruct-1M's dual-chunk config in small: chunks of 138 - 10 = 128, trained at 256
QWEN_1M_STYLE = {"chunk_size": 138, "local_size": 10, "original_max_position_embeddings": TRAIN_LENGTH}


@pytest.mark.slow
def test_a_qwen2_5_1m_dual_chunk_config_is_served_as_its_default(tmp_path):
    """A checkpoint that declares ``dual_chunk_attention_config`` (stock vLLM's V1 engine no longer
    runs it) starts with dual_chunk at its chunk and local sizes as the engine's defaults, trained
    at its ``original_max_position_embeddings``; a prompt of five chunks and a decode across a
    chunk edge answer as the oracle (ChunkLlama's formulas) does."""
    from rope_plugins.rules.settings import ExtensionSettings
    from tests.conftest import running_engine
    from tests.support.reference_forward import ReferenceModel

    directory = make_tiny_model(tmp_path, "qwen2", seed=5, config={"dual_chunk_attention_config": QWEN_1M_STYLE,
                                                                     "max_position_embeddings": 4 * TRAIN_LENGTH})
    declared = ExtensionSettings(method="dual_chunk", chunk_size=138, local_window=10, train_length=TRAIN_LENGTH)
    ids = prompt(730, 637)  # decoding crosses the chunk edge at 640
    with running_engine(directory, defaults=None) as llm:
        assert llm.llm_engine.model_config.hf_config.rope_extension == declared.model_dump()
        [result] = run(llm, [(ids, None)], declared)
    assert_matches_oracle(result, ids, None, ReferenceModel(directory), declared)
