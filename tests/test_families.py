"""Every served family through the real engine (rope_plugins/model.py): the stock vLLM model
with rotation moved into the plugin's attention, on a tiny random checkpoint of each real
architecture. ``none`` equals stock vLLM on the same checkpoint; every method, mixed in one
batch and prefilled in chunks, equals transformers' model of that family running the oracle."""

from __future__ import annotations

import pytest
import torch

from test_plugin_engine import PROMPT_LENGTH, assert_close_logprobs, assert_matches_oracle, prompt, run
from tiny_models import TRAIN_LENGTH, make_tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
ENGINE_DEFAULTS = {"method": "rerope", "window": 37}
MIXED = [{"method": "none"}, {"method": "rerope", "window": 37}, {"method": "leaky_rerope", "window": 50},
         {"method": "ntk_mixed", "factor": 4.0, "log_n": True}, {"method": "yarn", "factor": 4.0},
         {"method": "pi", "factor": 2.0}, {"method": "ntk_old", "factor": 4.0}, {"method": "ntk_fixed", "factor": 3.0}]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_oracle_with_none_is_transformers_own_model(name, tmp_path):
    """The reference forward (rotation off on full-attention layers, the oracle there; Gemma 3's
    local layers as transformers has them) under ``none`` is the family's own model."""
    from reference_forward import ReferenceModel
    from transformers import AutoModelForCausalLM

    from rope_plugins.settings import ExtensionSettings

    directory = make_tiny_model(tmp_path, name, seed=11)
    ids = prompt(7, 150)
    ours = ReferenceModel(directory).logits(ids, ExtensionSettings(train_length=TRAIN_LENGTH)).log_softmax(-1)
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = stock(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-5)


def engine(model_dir, **engine_args):
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
               kv_cache_memory_bytes=1 << 27, seed=0, **engine_args)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """One family at a time: its checkpoint, the plugin's engine (prompts prefilled in chunks of
    64 tokens), stock vLLM's engine and the oracle."""
    from reference_forward import ReferenceModel

    from rope_plugins.engine import compute_on_every_core, engine_kwargs
    from rope_plugins.settings import ExtensionSettings

    directory = make_tiny_model(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param, seed=11)
    compute_on_every_core()
    kwargs = engine_kwargs(str(directory), defaults=ENGINE_DEFAULTS, max_model_len=1024)
    model = kwargs.pop("model")
    plugin = engine(model, max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=True, **kwargs)
    stock = engine(directory, max_model_len=TRAIN_LENGTH)
    yield {"name": request.param, "plugin": plugin, "stock": stock, "reference": ReferenceModel(directory),
           "defaults": ExtensionSettings(train_length=TRAIN_LENGTH, **ENGINE_DEFAULTS)}
    for llm in (plugin, stock):
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_none_equals_stock_vllm(family):
    from vllm import SamplingParams

    requests = [(prompt(40 + i, 150 + 23 * i), {"method": "none"}) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    theirs = family["stock"].generate([{"prompt_token_ids": ids} for ids, _ in requests], params, use_tqdm=False)
    for (ids, _), stock_out, ours in zip(requests, theirs, run(family["plugin"], requests, family["defaults"])):
        stock_logprobs = torch.tensor([e[ids[i + 1]].logprob for i, e in enumerate(stock_out.prompt_logprobs[1:])],
                                      dtype=torch.float64)
        torch.testing.assert_close(ours.prompt_logprobs, stock_logprobs, rtol=0, atol=1e-4,
                                   msg=lambda m: f"{family['name']}: {m}")
        assert list(stock_out.outputs[0].token_ids) == ours.tokens, family["name"]
    # K and V planes only: the same cache memory holds as many blocks as stock vLLM's
    blocks = [llm.llm_engine.vllm_config.cache_config.num_gpu_blocks for llm in (family["plugin"], family["stock"])]
    assert blocks[0] == blocks[1], family["name"]


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
