"""The plugin on vLLM's V2 model runner (the default on GPUs), forced on this CPU by
``tests/support/v2_harness.py``: each request's settings reach attention through its request slot
(``rope_plugins/worker/model_state.py``). A batch of mixed methods prefilled in chunks answers as
the oracle does and as the V1 runner's one-step prefill does; slots freed by one batch take
the next batch's settings; the prefix cache never crosses settings; bad settings are refused
at admission, naming the field; an fp8 cache answers as its oracle does. Every test but the fp8
one runs once per entry of ``ATTENTION_OPS``."""

from __future__ import annotations

import pytest

from tests.frontend.test_engine_args import (
    BAD_SETTINGS,
    assert_bad_settings_refused,
    assert_close_logprobs,
    assert_matches_oracle,
    assert_prefix_cache_never_crosses_settings,
    prompt,
    run,
)
from tests.support.v2_harness import v2_engine as start_v2_engine

# the attention ops the V2 engine runs (engine_kwargs(attention_ops=...)): the CPU ops, and the
# Triton kernels under the interpreter (V2 with them is the GPU configuration)
ATTENTION_OPS = ["cpu", "triton"]
MIXED = [{"method": "rerope", "window": 37}, {"method": "leaky_rerope", "window": 50, "leaky_k": 3.0, "log_n": True},
         {"method": "yarn", "factor": 4.0}, {"method": "ntk_mixed", "factor": 4.0}, {"method": "none"},
         {"method": "self_extend", "window": 40, "group": 4}, {"method": "ntk_dynamic", "log_n": True},
         {"method": "string", "shift": 90, "local": 10},
         {"method": "dual_chunk", "chunk_size": 138, "local_window": 10}]
# Under the interpreter the Triton engine takes the first five, and the first batch alone: the
# others meet the same kernels in the V1 engine (tests/frontend/test_engine_args.py) and one by one
# in tests/ops/test_gpu.py, and which settings a freed slot takes is the runner's, whatever the kernels.
TRITON_MIXED = 5


@pytest.fixture(scope="module", params=ATTENTION_OPS)
def v2_engine(request, tiny_llama_dir):
    """The plugin's engine on the V2 runner, in a process of its own; prompts prefilled in
    chunks of 64 tokens, so chunks start inside and past the window."""
    with start_v2_engine(tiny_llama_dir, attention_ops=request.param, max_num_batched_tokens=64, max_num_seqs=8,
                         enable_chunked_prefill=True) as llm:
        llm.attention_ops = request.param
        yield llm


def test_the_engine_runs_the_v2_runner_with_the_plugins_model_state(v2_engine):
    facts = v2_engine.facts
    assert facts["use_v2_model_runner"]
    assert facts["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # V2's runner on CPU
    assert facts["model_state"] == "RopeExtendModelState"
    assert facts["dummy_run_error"] is None


def test_mixed_methods_in_chunks_match_the_oracle_and_the_v1_runner(v2_engine, full_engine, reference_model,
                                                                    engine_defaults):
    """MIXED's methods in one batch, prefilled in chunks, against the oracle and against the V1
    runner prefilling each prompt at once; then the same prompts with the methods shifted by one,
    in the slots the first batch freed (on Triton: the first five, once)."""
    on_cpu = v2_engine.attention_ops == "cpu"
    mixed = MIXED if on_cpu else MIXED[:TRITON_MIXED]
    first = [(prompt(700 + i, 300 - 13 * i), fields) for i, fields in enumerate(mixed)]
    second = [(ids, mixed[(i + 1) % len(mixed)]) for i, (ids, _) in enumerate(first)]
    for requests in (first, second) if on_cpu else (first,):
        on_v2, on_v1 = run(v2_engine, requests, engine_defaults), run(full_engine, requests, engine_defaults)
        for result, v1_result, (ids, fields) in zip(on_v2, on_v1, requests):
            assert_matches_oracle(result, ids, fields, reference_model, engine_defaults)
            assert_close_logprobs(result.prompt_logprobs, v1_result.prompt_logprobs, f"{fields} V2 vs V1")
            assert result.tokens == v1_result.tokens, fields


# The salt is the front's and the scheduler's, the same whatever the kernels: the V1 runner's
# test runs both kernel sets, and V2 its CPU ones (the Triton interpreter's run took 40 s).
@pytest.mark.parametrize("v2_engine", ["cpu"], indirect=True)
def test_prefix_cache_never_crosses_settings_on_v2(v2_engine, reference_model, engine_defaults):
    assert_prefix_cache_never_crosses_settings(v2_engine, 800, reference_model, engine_defaults)


@pytest.mark.parametrize("fields,field", BAD_SETTINGS)
def test_bad_settings_are_refused_naming_the_field_on_v2(v2_engine, engine_defaults, fields, field):
    assert_bad_settings_refused(v2_engine, engine_defaults, fields, field)


def test_mixed_methods_in_chunks_on_an_fp8_cache_match_the_oracle_on_v2(tiny_llama_dir, engine_defaults):
    """The V2 runner on an fp8 (e4m3) cache, the CPU ops: MIXED in one batch, prefilled in chunks
    of 64 tokens, against the oracle on the cache's values (tests/ops/test_fp8_cache.py says why
    its bounds are what they are)."""
    from tests.ops.test_fp8_cache import assert_match_the_fp8_oracle, fp8_oracle

    requests = [(prompt(700 + i, 300 - 13 * i), fields) for i, fields in enumerate(MIXED)]
    with start_v2_engine(tiny_llama_dir, attention_ops="cpu", kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=64,
                         max_num_seqs=8, enable_chunked_prefill=True) as llm:
        results = run(llm, requests, engine_defaults)
    assert_match_the_fp8_oracle(results, requests, fp8_oracle(tiny_llama_dir, "fp8_e4m3"), engine_defaults)
