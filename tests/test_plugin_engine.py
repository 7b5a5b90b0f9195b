"""The plugin through the real vLLM engine against the oracle (transformers + reference
attention) on a tiny random Llama: every method alone and mixed in one batch, past the
window and past max_position_embeddings, chunked prefill, prefix-cache hits, stock vLLM."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rope_plugins.engine import FEW_CORES
from rope_plugins.settings import parse_settings
from tiny_llama import TRAIN_LENGTH

PROMPT_LENGTH = 600  # > 2 x max_position_embeddings (256), >> every window
NEW_TOKENS = 6
LOGPROB_TOLERANCE = 2e-5  # fp32 engine vs float64 oracle

METHODS = [
    {"method": "none"},
    {"method": "none", "log_n": True},
    {"method": "pi", "factor": 4.0},
    {"method": "ntk_old", "factor": 4.0},
    {"method": "ntk_fixed", "factor": 4.0},
    {"method": "ntk_mixed", "factor": 4.0},
    {"method": "ntk_mixed", "factor": 3.0, "beta": 0.3, "log_n": True},
    {"method": "yarn", "factor": 4.0},
    {"method": "yarn", "factor": 2.5, "log_n": True},
    {"method": "rerope", "window": 37},
    {"method": "rerope", "window": 64, "log_n": True},
    {"method": "leaky_rerope", "window": 37, "leaky_k": 8.0},
    {"method": "leaky_rerope", "window": 50, "leaky_k": 3.0, "log_n": True},
]


def prompt(seed: int, length: int = PROMPT_LENGTH) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 256) for _ in range(length)]


def run(llm, requests, defaults, max_tokens=NEW_TOKENS, prompt_logprobs=True):
    """requests: [(token_ids, fields)] in one generate call -> [(logprobs, tokens, output)]:
    the prompt's logprobs, or (``prompt_logprobs=False``, which lets vLLM read the prefix
    cache) the logprobs of the generated tokens."""
    from vllm import SamplingParams

    from rope_plugins.engine import extension_request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=0 if prompt_logprobs else None,
                            logprobs=0, ignore_eos=True)
    built = [extension_request({"prompt_token_ids": ids}, params, fields, defaults) for ids, fields in requests]
    outputs = llm.generate([p for p, _, _ in built], [sp for _, sp, _ in built], use_tqdm=False)
    results = []
    for (ids, _), output in zip(requests, outputs):
        generated = list(output.outputs[0].token_ids)
        if prompt_logprobs:
            logprobs = [entry[ids[i + 1]].logprob for i, entry in enumerate(output.prompt_logprobs[1:])]
        else:
            logprobs = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, generated)]
        results.append((torch.tensor(logprobs, dtype=torch.float64), generated, output))
    return results


def assert_matches_oracle(result, ids, fields, reference_model, defaults):
    settings = parse_settings(fields, defaults)
    logprobs, tokens, _ = result
    expected = reference_model.prompt_logprobs(ids, settings)
    gap = (logprobs - expected).abs().max().item()
    assert gap < LOGPROB_TOLERANCE, f"{fields}: prompt logprobs differ by {gap}"
    assert tokens == reference_model.greedy(ids, settings, NEW_TOKENS), fields


@pytest.mark.parametrize("fields", METHODS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_each_method_alone_matches_oracle(full_engine, reference_model, engine_defaults, fields):
    ids = prompt(1)
    [result] = run(full_engine, [(ids, fields)], engine_defaults)
    assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)


def test_all_methods_mixed_in_one_batch(full_engine, reference_model, engine_defaults):
    requests = [(prompt(100 + i, PROMPT_LENGTH - 7 * i), fields) for i, fields in enumerate(METHODS)]
    for result, (ids, fields) in zip(run(full_engine, requests, engine_defaults), requests):
        assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)


def test_chunked_prefill_matches_one_full_prefill(full_engine, chunked_engine, reference_model, engine_defaults):
    chosen = [METHODS[0], METHODS[5], METHODS[8], METHODS[9], METHODS[12]]
    requests = [(prompt(200 + i), fields) for i, fields in enumerate(chosen)]
    chunked = run(chunked_engine, requests, engine_defaults)
    full = run(full_engine, requests, engine_defaults)
    for (chunk_result, full_result), (ids, fields) in zip(zip(chunked, full), requests):
        assert (chunk_result[0] - full_result[0]).abs().max().item() < LOGPROB_TOLERANCE
        assert chunk_result[1] == full_result[1]
        assert_matches_oracle(chunk_result, ids, fields, reference_model, engine_defaults)


@pytest.mark.parametrize("engine_name", ["full_engine", "chunked_engine"])
def test_prefix_cache_never_crosses_settings(request, engine_name, reference_model, engine_defaults):
    llm = request.getfixturevalue(engine_name)
    seed = 300 if engine_name == "full_engine" else 400
    ids = prompt(seed)
    setting_a, setting_b = {"method": "rerope", "window": 40}, {"method": "ntk_mixed", "factor": 4.0}
    run(llm, [(ids, setting_a)], engine_defaults)
    [b_after_a] = run(llm, [(ids, setting_b)], engine_defaults)
    assert not b_after_a[2].num_cached_tokens, "a request reused blocks computed under other settings"
    assert_matches_oracle(b_after_a, ids, setting_b, reference_model, engine_defaults)
    # the same settings share their prefix, and the hit changes nothing (prompt logprobs
    # would make vLLM skip the cache, so these compare the generated tokens' logprobs)
    [b_fresh] = run(llm, [(ids + [7], setting_b)], engine_defaults, prompt_logprobs=False)
    [b_hit] = run(llm, [(ids + [7], setting_b)], engine_defaults, prompt_logprobs=False)
    assert b_hit[2].num_cached_tokens >= 512
    assert (b_hit[0] - b_fresh[0]).abs().max().item() < LOGPROB_TOLERANCE and b_hit[1] == b_fresh[1]
    # a longer prompt on a cached prefix: prefill starts from a cached context
    longer = ids + [7] + prompt(seed + 1, 150)
    [extended] = run(llm, [(longer, setting_b)], engine_defaults, prompt_logprobs=False)
    assert extended[2].num_cached_tokens >= 512
    settings = parse_settings(setting_b, engine_defaults)
    assert extended[1] == reference_model.greedy(longer, settings, NEW_TOKENS)
    expected = reference_model.continuation_logprobs(longer, extended[1], settings)
    assert (extended[0] - expected).abs().max().item() < LOGPROB_TOLERANCE


def test_none_equals_stock_vllm_llama(tiny_llama_dir, full_engine, engine_defaults):
    from vllm import LLM, SamplingParams

    stock = LLM(model=str(tiny_llama_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                block_size=32, kv_cache_memory_bytes=1 << 27, max_model_len=TRAIN_LENGTH, seed=0)
    try:
        requests = [(prompt(500 + i, 200 + 11 * i), {"method": "none"}) for i in range(3)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        stock_out = stock.generate([{"prompt_token_ids": ids} for ids, _ in requests], params, use_tqdm=False)
        plugin = run(full_engine, requests, engine_defaults)
        for (ids, _), theirs, ours in zip(requests, stock_out, plugin):
            stock_logprobs = torch.tensor([e[ids[i + 1]].logprob for i, e in enumerate(theirs.prompt_logprobs[1:])], dtype=torch.float64)
            assert (stock_logprobs - ours[0]).abs().max().item() < 1e-4
            assert list(theirs.outputs[0].token_ids) == ours[1]
        # K and V planes only: the same cache memory holds as many blocks as stock vLLM's
        stock_blocks = stock.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert full_engine.llm_engine.vllm_config.cache_config.num_gpu_blocks == stock_blocks
    finally:
        stock.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("fields,field", [({"method": "rerope3"}, "method"), ({"window": -4}, "window"),
                                          ({"factor": 0.1}, "factor"), ({"bogus": 1}, "bogus")])
def test_bad_settings_are_refused_and_the_engine_goes_on(full_engine, engine_defaults, fields, field):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    params = SamplingParams(max_tokens=2, extra_args={"context_extension": fields})
    with pytest.raises(VLLMValidationError, match=f"context_extension.{field}") as caught:
        full_engine.generate([{"prompt_token_ids": prompt(9, 20)}], params, use_tqdm=False)
    assert caught.value.parameter == f"context_extension.{field}"
    [ok] = run(full_engine, [(prompt(9, 20), None)], engine_defaults, max_tokens=2)
    assert len(ok[1]) == 2


def test_serving_past_training_length_needs_a_method(tiny_llama_dir):
    from rope_plugins.engine import engine_kwargs

    with pytest.raises(ValueError, match="past the checkpoint's training length 256"):
        engine_kwargs(str(tiny_llama_dir), defaults={"method": "none"}, max_model_len=1024)
    kwargs = engine_kwargs(str(tiny_llama_dir), defaults={"method": "rerope"}, max_model_len=1024)
    assert kwargs["hf_overrides"]["max_position_embeddings"] == 1024
    assert kwargs["hf_overrides"]["rope_extension"]["train_length"] == 256


def test_the_worker_computes_on_every_core(full_engine):
    """vLLM's CPU worker keeps a core for its scheduler unless told otherwise: half of a 2-core
    machine. compute_on_every_core (called by the fixtures, as by the server's main) tells it
    not to on small machines, so the worker's threads are
    pinned across every core this process may use."""
    import psutil

    cores = os.sched_getaffinity(0)
    if len(cores) > FEW_CORES:
        pytest.skip("vLLM's own reservation applies on larger machines")
    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in p.name()]
    assert workers, "no vLLM worker process found"
    pinned = set()
    for worker in workers:
        for thread in worker.threads():
            pinned |= os.sched_getaffinity(thread.id)  # a thread id is a pid for the scheduler
    assert pinned == cores
