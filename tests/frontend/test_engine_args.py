"""The plugin through the real vLLM engine against the oracle (transformers + reference
attention) on a tiny random Llama: every method alone and mixed in one batch, past the
window and past max_position_embeddings, chunked prefill, prefix-cache hits, stock vLLM."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

from rope_plugins.frontend import engine_args
from rope_plugins.frontend.engine_args import FEW_CORES
from rope_plugins.rules.settings import parse_settings
from tests.conftest import running_engine, stock_engine

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
    {"method": "self_extend", "window": 37, "group": 4},
    {"method": "self_extend", "window": 50, "group": 8, "log_n": True},
    # θ steps at 256 + 128 j: a 600-token prompt runs under four
    {"method": "ntk_dynamic"},
    {"method": "ntk_dynamic", "log_n": True},
    # STRING: the default shift (256 / 3) and local value, and a wider shift with log-n
    {"method": "string"},
    {"method": "string", "shift": 100, "local": 20, "log_n": True},
    # dual-chunk: the defaults (chunk size 144, local window 16: chunks of 128) and chunks of 64 with log-n
    {"method": "dual_chunk"},
    {"method": "dual_chunk", "chunk_size": 100, "local_window": 36, "log_n": True},
]


def prompt(seed: int, length: int = PROMPT_LENGTH) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 256) for _ in range(length)]


@dataclass
class Generation:
    """One request's answer: its tokens, their log-probabilities, the prompt's (when asked)."""

    tokens: list[int]
    logprobs: torch.Tensor  # [tokens] float64
    prompt_logprobs: torch.Tensor | None  # [prompt - 1]
    cached_tokens: int  # prompt tokens read from the prefix cache


def run(llm, requests, defaults, max_tokens=NEW_TOKENS, prompt_logprobs=True, salted=True) -> list[Generation]:
    """requests: [(token_ids, fields)] in one generate call. ``prompt_logprobs`` makes vLLM
    skip reading the prefix cache; ``salted=False`` drops the settings' cache salt (only the
    negative control does that)."""
    from vllm import SamplingParams

    from rope_plugins.frontend.engine_args import extension_request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=0 if prompt_logprobs else None,
                            logprobs=0, ignore_eos=True)
    built = [extension_request({"prompt_token_ids": ids}, params, resolved(ids, fields, defaults, max_tokens))
             for ids, fields in requests]
    prompts = [p if salted else {"prompt_token_ids": p["prompt_token_ids"]} for p, _ in built]
    outputs = llm.generate(prompts, [sp for _, sp in built], use_tqdm=False)
    results = []
    for (ids, _), output in zip(requests, outputs):
        tokens = list(output.outputs[0].token_ids)
        logprobs = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, tokens)]
        prompt = None
        if prompt_logprobs:
            prompt = torch.tensor([entry[ids[i + 1]].logprob for i, entry in enumerate(output.prompt_logprobs[1:])],
                                  dtype=torch.float64)
        results.append(Generation(tokens=tokens, logprobs=torch.tensor(logprobs, dtype=torch.float64),
                                  prompt_logprobs=prompt, cached_tokens=output.num_cached_tokens or 0))
    return results


def resolved(ids: list[int], fields, defaults, max_tokens: int):
    """A request's settings: ``fields`` over the engine's defaults; ``factor: "auto"`` sized to the
    request by the server's one function (its defaults the engine's)."""
    if isinstance(fields, dict) and fields.get("factor") == "auto":
        from rope_plugins.rules.settings import positions_used
        from rope_plugins.server.extension import ServerDefaults, resolve_extension
        from rope_plugins.server.schemas import ContextExtension

        server = ServerDefaults(flags={}, engine_default=defaults, auto_method=None, auto_log_n=True,
                                served=defaults.train_length)
        return resolve_extension(ContextExtension.model_validate(fields), server, positions_used(len(ids), max_tokens))
    return parse_settings(fields, defaults)


def assert_close_logprobs(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=LOGPROB_TOLERANCE, msg=lambda m: f"{what}: {m}")


def assert_matches_oracle(result: Generation, ids, fields, reference_model, defaults):
    """The prompt's log-probabilities (when asked), every generated token's log-probability,
    and greedy's choice at every step, against the float64 oracle."""
    settings = parse_settings(fields, defaults)
    prompt_expected, expected, greedy = reference_model.answer(ids, result.tokens, settings)
    if result.prompt_logprobs is not None:
        assert_close_logprobs(result.prompt_logprobs, prompt_expected, f"{fields} prompt")
    assert result.tokens == greedy, fields
    assert_close_logprobs(result.logprobs, expected, f"{fields} decode")


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
    chosen = [METHODS[0], METHODS[5], METHODS[8], METHODS[9], METHODS[12], METHODS[14], METHODS[16], METHODS[18]]
    requests = [(prompt(200 + i), fields) for i, fields in enumerate(chosen)]
    chunked = run(chunked_engine, requests, engine_defaults)
    full = run(full_engine, requests, engine_defaults)
    for (chunk_result, full_result), (ids, fields) in zip(zip(chunked, full), requests):
        assert_close_logprobs(chunk_result.prompt_logprobs, full_result.prompt_logprobs, f"{fields} chunked")
        assert chunk_result.tokens == full_result.tokens
        assert_matches_oracle(chunk_result, ids, fields, reference_model, engine_defaults)


# Each method once, half of them with log-n: under the interpreter every request costs seconds,
# and every method, with and without log-n, meets the Triton kernels in tests/ops/test_gpu.py.
TRITON_METHODS = [METHODS[i] for i in (0, 2, 3, 4, 6, 7, 10, 11, 14, 15, 18, 19)]


def test_triton_kernels_in_the_engine_match_the_oracle_and_the_cpu_ops(triton_engine, full_engine, reference_model,
                                                                       engine_defaults):
    """Every method in one batch through the Triton kernels (the GPU path, here under Triton's
    interpreter), prefilled in chunks of 128: the oracle's answers, and the CPU ops' to 2e-5."""
    requests = [(prompt(500 + i, 300 - 5 * i), fields) for i, fields in enumerate(TRITON_METHODS)]
    kernels, cpu_ops = run(triton_engine, requests, engine_defaults), run(full_engine, requests, engine_defaults)
    for result, cpu_result, (ids, fields) in zip(kernels, cpu_ops, requests):
        assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)
        assert_close_logprobs(result.prompt_logprobs, cpu_result.prompt_logprobs, f"{fields} triton vs cpu ops")
        assert result.tokens == cpu_result.tokens


FREQUENCY_METHODS = ["pi", "ntk_old", "ntk_fixed", "ntk_mixed", "yarn"]


def test_auto_factor_is_plain_rope_inside_training_and_sized_to_the_request_past_it(full_engine, reference_model,
                                                                                   engine_defaults):
    """``factor: "auto"``: inside the training length every frequency method is plain RoPE (the
    oracle's ``none``); past it, the method at ``(prompt + max_tokens - 1) / train_length``, which is
    what the request's settings (and so its cache salt) carry."""
    train = engine_defaults.train_length
    inside, past = prompt(800, train - NEW_TOKENS - 40), prompt(801)
    requests = [(ids, {"method": method, "factor": "auto"}) for method in FREQUENCY_METHODS for ids in (inside, past)]
    results = run(full_engine, requests, engine_defaults)
    for result, (ids, fields) in zip(results, requests):
        factor = (len(ids) + NEW_TOKENS - 1) / train if ids is past else 1.0  # the last token takes no position
        assert resolved(ids, fields, engine_defaults, NEW_TOKENS).factor == factor
        expected = {"method": "none"} if ids is inside else {"method": fields["method"], "factor": factor}
        assert_matches_oracle(result, ids, expected, reference_model, engine_defaults)


def test_ntk_dynamic_decodes_across_a_step_of_its_factor(full_engine, chunked_engine, reference_model,
                                                        engine_defaults):
    """Generated tokens cross the step at position 512 (and the C++ decode's 512-key chunk):
    each one's θ follows the length it has seen, in one prefill and in chunks of 64."""
    fields = {"method": "ntk_dynamic"}
    ids = prompt(700, 509)
    for llm in (full_engine, chunked_engine):
        [result] = run(llm, [(ids, fields)], engine_defaults)
        assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)


def test_dual_chunk_decodes_across_a_chunk_edge(full_engine, chunked_engine, reference_model, engine_defaults):
    """Generated tokens cross the chunk edge at 640 (chunks of 64 and of 128), where the keys'
    positions start again and the chunk before turns near: in one prefill and in chunks of 64."""
    ids = prompt(720, 637)
    requests = [(ids, fields) for fields in METHODS if fields["method"] == "dual_chunk"]
    for llm in (full_engine, chunked_engine):
        for result, (_, fields) in zip(run(llm, requests, engine_defaults), requests):
            assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)


def test_ntk_dynamic_reuses_a_cached_prefix_of_another_length(full_engine, reference_model, engine_defaults):
    """A position's θ depends on the tokens before it, not on the request's length, so the K/V
    of a prefix are the same in every ntk_dynamic request (at one train_length): a longer
    request reads a shorter one's blocks and answers as the oracle does. A request at another
    train_length does not (its salt differs)."""
    fields = {"method": "ntk_dynamic"}
    short = prompt(710, 420)
    run(full_engine, [(short, fields)], engine_defaults, prompt_logprobs=False)
    longer = short + prompt(711, 200)
    [extended] = run(full_engine, [(longer, fields)], engine_defaults, prompt_logprobs=False)
    assert extended.cached_tokens >= 400
    assert_matches_oracle(extended, longer, fields, reference_model, engine_defaults)
    other = {**fields, "train_length": 128}
    [elsewhere] = run(full_engine, [(longer, other)], engine_defaults, prompt_logprobs=False)
    assert elsewhere.cached_tokens == 0
    assert_matches_oracle(elsewhere, longer, other, reference_model, engine_defaults)


# The salt is the front's and the scheduler's, the same whatever the kernels; a Triton prefill
# after cached tokens is the triton_engine's every chunk after its first (the test above).
@pytest.mark.parametrize("engine_name", ["full_engine", "chunked_engine"])
def test_prefix_cache_never_crosses_settings(request, engine_name, reference_model, engine_defaults):
    seed = {"full_engine": 300, "chunked_engine": 400}[engine_name]
    assert_prefix_cache_never_crosses_settings(request.getfixturevalue(engine_name), seed, reference_model,
                                               engine_defaults)


def assert_prefix_cache_never_crosses_settings(llm, seed: int, reference_model, engine_defaults) -> None:
    """Every run here reads the prefix cache (no prompt log-probabilities). A prompt cached
    under A is not reused under B, and B's answer is B's; B's own blocks are reused and change
    nothing; and the negative control: without the salt, B does reuse A's blocks and answers
    differently, so a salt that failed would show. ``seed`` picks prompts new to ``llm``."""
    setting_a, setting_b = {"method": "rerope", "window": 40}, {"method": "ntk_mixed", "factor": 4.0}
    ids = prompt(seed)
    [a_first] = run(llm, [(ids, setting_a)], engine_defaults, prompt_logprobs=False)
    assert a_first.cached_tokens == 0, "the prompt is new to this engine"
    [b_after_a] = run(llm, [(ids, setting_b)], engine_defaults, prompt_logprobs=False)
    assert b_after_a.cached_tokens == 0, "a request reused blocks computed under other settings"
    assert_matches_oracle(b_after_a, ids, setting_b, reference_model, engine_defaults)
    [b_hit] = run(llm, [(ids, setting_b)], engine_defaults, prompt_logprobs=False)
    assert b_hit.cached_tokens >= 512
    assert_close_logprobs(b_hit.logprobs, b_after_a.logprobs, "cache hit")
    assert b_hit.tokens == b_after_a.tokens
    # a longer prompt on a cached prefix: prefill starts from a cached context
    longer = ids + prompt(seed + 1, 150)
    [extended] = run(llm, [(longer, setting_b)], engine_defaults, prompt_logprobs=False)
    assert extended.cached_tokens >= 512
    assert_matches_oracle(extended, longer, setting_b, reference_model, engine_defaults)

    control = prompt(seed + 2)
    run(llm, [(control, setting_a)], engine_defaults, prompt_logprobs=False, salted=False)
    [crossed] = run(llm, [(control, setting_b)], engine_defaults, prompt_logprobs=False, salted=False)
    assert crossed.cached_tokens >= 512, "unsalted, the same tokens share their blocks"
    expected, _ = reference_model.continuation(control, crossed.tokens, parse_settings(setting_b, engine_defaults))
    assert (crossed.logprobs - expected).abs().max().item() > 100 * LOGPROB_TOLERANCE, \
        "A's keys under B's rule went unnoticed: this test could not catch a salt that failed"


def assert_none_equals_stock(plugin, stock, requests, defaults, what: str = "") -> None:
    """``none`` through the plugin answers as stock vLLM: the prompts' log-probabilities (1e-4),
    the greedy tokens, and as many KV blocks in the same cache memory (K and V planes only)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    theirs = stock.generate([{"prompt_token_ids": ids} for ids, _ in requests], params, use_tqdm=False)
    for (ids, _), stock_out, ours in zip(requests, theirs, run(plugin, requests, defaults)):
        stock_logprobs = torch.tensor([e[ids[i + 1]].logprob for i, e in enumerate(stock_out.prompt_logprobs[1:])],
                                      dtype=torch.float64)
        torch.testing.assert_close(ours.prompt_logprobs, stock_logprobs, rtol=0, atol=1e-4,
                                   msg=lambda m: f"{what}: {m}")
        assert list(stock_out.outputs[0].token_ids) == ours.tokens, what
    blocks = [llm.llm_engine.vllm_config.cache_config.num_gpu_blocks for llm in (plugin, stock)]
    assert blocks[0] == blocks[1], what


def test_none_equals_stock_vllm_llama(tiny_llama_dir, full_engine, engine_defaults):
    with stock_engine(tiny_llama_dir) as stock:
        requests = [(prompt(500 + i, 200 + 11 * i), {"method": "none"}) for i in range(3)]
        assert_none_equals_stock(full_engine, stock, requests, engine_defaults, "llama")


BAD_SETTINGS = [({"method": "rerope3"}, "method"), ({"window": -4}, "window"), ({"factor": 0.1}, "factor"),
                ({"bogus": 1}, "bogus")]


@pytest.mark.parametrize("fields,field", BAD_SETTINGS)
def test_bad_settings_are_refused_and_the_engine_goes_on(full_engine, engine_defaults, fields, field):
    assert_bad_settings_refused(full_engine, engine_defaults, fields, field)


def assert_bad_settings_refused(llm, engine_defaults, fields, field: str) -> None:
    """A request with bad ``fields`` is refused at admission naming ``field``; the next is served."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    params = SamplingParams(max_tokens=2, extra_args={"context_extension": fields})
    with pytest.raises(VLLMValidationError, match=f"context_extension.{field}") as caught:
        llm.generate([{"prompt_token_ids": prompt(9, 20)}], params, use_tqdm=False)
    assert caught.value.parameter == f"context_extension.{field}"
    [ok] = run(llm, [(prompt(9, 20), None)], engine_defaults, max_tokens=2)
    assert len(ok.tokens) == 2


def test_serving_past_training_length_needs_a_method(tiny_llama_dir):
    from rope_plugins.frontend.engine_args import engine_kwargs

    with pytest.raises(ValueError, match="past the checkpoint's training length 256"):
        engine_kwargs(str(tiny_llama_dir), defaults={"method": "none"}, max_model_len=1024)
    kwargs = engine_kwargs(str(tiny_llama_dir), defaults={"method": "rerope"}, max_model_len=1024)
    assert kwargs["hf_overrides"]["max_position_embeddings"] == 1024
    assert kwargs["hf_overrides"]["rope_extension"]["train_length"] == 256


def test_the_worker_computes_on_every_core(triton_engine):
    """vLLM's CPU worker keeps a core for its scheduler unless told otherwise: half of a 2-core
    machine. compute_on_every_core (called by the fixtures, as by the server's main) tells it
    not to on small machines, so the worker's threads are pinned across every core this process
    may use. (The engine whose worker is a process of its own, as the server's is.)"""
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


BF16_METHODS = [fields for fields in METHODS if fields["method"] in ("none", "rerope", "leaky_rerope", "ntk_mixed",
                                                                     "yarn", "self_extend", "string", "dual_chunk")]


def oracle_error(result: Generation, ids, fields, reference_model, defaults) -> float:
    """The largest difference of a request's prompt log-probabilities from the float64 oracle's."""
    expected = reference_model.prompt_logprobs(ids, parse_settings(fields, defaults))
    return float((result.prompt_logprobs - expected).abs().max())


def test_bfloat16_engine_is_as_close_to_the_oracle_as_stock_bfloat16(tiny_llama_dir, reference_model,
                                                                     engine_defaults):
    """In bfloat16 the model's every layer rounds (2^-8), so neither engine matches the float64
    oracle to fp32's 2e-5. The plugin's own part, attention on a bfloat16 cache in float32 with
    one rounding of its output (``attention_precision`` float32: its dot products' operands to
    2^-16), must not add to that: on ``none`` inside training its error is within 1.5x stock
    bfloat16's and its greedy tokens are stock's; every method, mixed in one batch past training,
    stays within 2x stock's error (measured: none 0.6-0.7x, the methods at most 1.4x). The default
    precision, each operand rounded once as stock's, is held to the oracle kernel by kernel
    (tests/attention) and on real text by bench/dtype_check.py."""
    inside = [(prompt(800 + i, 200 + 17 * i), {"method": "none"}) for i in range(2)]
    past = [(prompt(900 + i), fields) for i, fields in enumerate(BF16_METHODS)]
    with running_engine(tiny_llama_dir, dtype="bfloat16", attention_precision="float32",
                        max_num_batched_tokens=4096, max_num_seqs=16) as llm:
        ours = run(llm, inside + past, engine_defaults)
    with stock_engine(tiny_llama_dir, dtype="bfloat16") as stock:
        theirs = run(stock, inside, engine_defaults, prompt_logprobs=True)
    stock_error = max(oracle_error(r, ids, f, reference_model, engine_defaults) for r, (ids, f) in zip(theirs, inside))
    errors = [oracle_error(r, ids, f, reference_model, engine_defaults) for r, (ids, f) in zip(ours, inside + past)]
    assert max(errors[: len(inside)]) <= 1.5 * stock_error
    assert [r.tokens for r in ours[: len(inside)]] == [r.tokens for r in theirs]
    assert max(errors) <= 2 * stock_error, list(zip(errors, inside + past))


def test_the_preloads_go_ahead_of_the_users_once_each(tmp_path, monkeypatch):
    """tcmalloc and Intel OpenMP go in front of what LD_PRELOAD holds, each once, only where found;
    ROPE_EXTEND_PRELOAD=0 leaves LD_PRELOAD alone."""
    tcmalloc, iomp = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    tcmalloc.touch()
    monkeypatch.setattr(engine_args, "PRELOADED", {"libtcmalloc": (str(tmp_path / "libtcmalloc_minimal.so*"),),
                                                   "libiomp": (str(iomp),)})
    monkeypatch.setenv("LD_PRELOAD", "/opt/users.so")
    monkeypatch.delenv(engine_args.PRELOAD_ENV, raising=False)
    assert engine_args.preload_cpu_libraries() == [str(tcmalloc)]  # no Intel OpenMP here
    iomp.touch()
    assert engine_args.preload_cpu_libraries() == [str(iomp)]  # tcmalloc is there already
    assert os.environ["LD_PRELOAD"] == f"{iomp}:{tcmalloc}:/opt/users.so"
    assert engine_args.preload_cpu_libraries() == []
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv(engine_args.PRELOAD_ENV, "0")
    assert engine_args.preload_cpu_libraries() == [] and os.environ["LD_PRELOAD"] == ""


def test_intel_openmp_is_not_preloaded_beside_another_openmp(tmp_path, monkeypatch):
    """vLLM's executor refuses two OpenMP runtimes in LD_PRELOAD, and vLLM's CPU platform adds
    PyTorch's libgomp whenever a config is checked in a process without one: Intel OpenMP then
    stays out (tcmalloc still goes in), so that such a process's engine starts."""
    from vllm.config import VllmConfig

    tcmalloc, iomp = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    tcmalloc.touch(), iomp.touch()
    monkeypatch.setattr(engine_args, "PRELOADED", {"libtcmalloc": (str(tcmalloc),), "libiomp": (str(iomp),)})
    monkeypatch.delenv(engine_args.PRELOAD_ENV, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    VllmConfig()  # what put libgomp there in the suite before this test
    assert "libgomp" in os.environ["LD_PRELOAD"]
    assert engine_args.preload_cpu_libraries() == [str(tcmalloc)]
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/llvm/libomp.so")
    assert engine_args.preload_cpu_libraries() == [str(tcmalloc)]
