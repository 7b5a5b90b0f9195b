"""Seeded sampling at every prompt length (rope_plugins/worker/seeded.py): the engine survives a
seeded prompt prefilled in chunks, and the same seed and prompt give the same tokens however
the prompt is chunked, batched, cached or extended."""

from __future__ import annotations

import random

import numpy as np
import torch

from rope_plugins.frontend.engine_args import SEEDED_CPU_WORKER, engine_kwargs, extension_request
from rope_plugins.rules.settings import parse_settings
from rope_plugins.worker.seeded import discarded_rows, set_aside
from tests.conftest import ENGINE_DEFAULTS, MAX_MODEL_LEN

NEW_TOKENS = 12
# the chunked engine's step holds 64 tokens: these prompts take 4 to 10 chunks, each but the
# last sampling a token that is thrown away
SETTINGS = [{"method": "none"}, {"method": "rerope", "window": 37}, {"method": "leaky_rerope", "window": 50,
            "leaky_k": 3.0, "log_n": True}, {"method": "ntk_mixed", "factor": 4.0}, {"method": "self_extend",
            "window": 37, "group": 4}]


def long_prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 256) for _ in range(length)]


def sampled(llm, requests, engine_defaults, n: int = 1) -> list[list[list[int]]]:
    """requests: [(token_ids, settings fields, seed)] in one generate call, sampled at temperature
    1 (seed None: unseeded); each request's n completions' tokens."""
    from vllm import SamplingParams

    prompts, params = [], []
    for ids, fields, seed in requests:
        base = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompt, param = extension_request({"prompt_token_ids": ids}, base, parse_settings(fields, engine_defaults))
        prompts.append(prompt)
        params.append(param)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(completion.token_ids) for completion in output.outputs] for output in outputs]


def test_a_seeded_prompt_in_chunks_gives_the_same_tokens_alone_batched_and_cached(chunked_engine, engine_defaults):
    """Each setting's seeded prompt: cold (prefilled in chunks), again (its blocks now cached:
    fewer chunks), and inside a batch of other seeded and unseeded long prompts. A runner that
    let the discarded draws advance the generator shifts the tokens by one per chunk."""
    for index, fields in enumerate(SETTINGS):
        ids = long_prompt(900 + index, 250 + 80 * index)
        [[cold]] = sampled(chunked_engine, [(ids, fields, 7)], engine_defaults)
        [[again]] = sampled(chunked_engine, [(ids, fields, 7)], engine_defaults)
        others = [(long_prompt(950 + index, 300), SETTINGS[index - 1], 11), (long_prompt(960, 200), fields, None)]
        batched = sampled(chunked_engine, [others[0], (ids, fields, 7), others[1]], engine_defaults)
        assert cold == again == batched[1][0], fields
        [[other_seed]] = sampled(chunked_engine, [(ids, fields, 8)], engine_defaults)
        assert other_seed != cold, "another seed draws other tokens"


def test_seeded_n_completions_repeat_and_differ_from_each_other(chunked_engine, engine_defaults):
    ids = long_prompt(980, 400)
    [first] = sampled(chunked_engine, [(ids, SETTINGS[1], 5)], engine_defaults, n=3)
    [second] = sampled(chunked_engine, [(ids, SETTINGS[1], 5)], engine_defaults, n=3)
    assert first == second
    assert len({tuple(tokens) for tokens in first}) == 3


def test_the_engine_runs_the_seeded_worker_on_the_cpu(tiny_llama_dir):
    kwargs = engine_kwargs(str(tiny_llama_dir), defaults=ENGINE_DEFAULTS, max_model_len=MAX_MODEL_LEN)
    assert kwargs["worker_cls"] == SEEDED_CPU_WORKER
    mine = engine_kwargs(str(tiny_llama_dir), defaults=ENGINE_DEFAULTS, max_model_len=MAX_MODEL_LEN,
                         worker_cls="my.Worker")
    assert mine["worker_cls"] == "my.Worker"


def test_generators_of_discarded_rows_are_set_aside_and_put_back():
    generators = {0: torch.Generator(), 2: torch.Generator(), 5: torch.Generator()}
    kept = dict(generators)
    rows = discarded_rows(np.array([False, True, True, False, False, True, True]), 6)
    assert rows == [1, 2, 5]
    with set_aside(generators, rows):
        assert set(generators) == {0}
    assert generators == kept
