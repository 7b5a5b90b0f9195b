"""The attention backend's paths on a hand-made paged cache, against the oracle: the C++
decode and prefill kernels, the plain PyTorch fallback, prefill from a cached context; and
the log-sum-exp merge (rope_plugins/attention/backend.py, planner.py, ops/, testing/merge.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_plugins.attention.backend import RopeExtendAttentionImpl
from rope_plugins.attention.planner import StepPlanner
from rope_plugins.ops import cpu, native
from rope_plugins.plugin import PRECISION_KEY
from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.testing.merge import merge_partials
from rope_plugins.testing.paged_steps import paged_step

# Where a C++ compiler exists the kernel must build: a failed build fails these tests.
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")

TRAIN, D, KV, QUERIES_PER_KV, BLOCK = 64, 32, 2, 3, 16
ROWS = [  # (settings, context length before this step, query tokens this step)
    (ExtensionSettings(method="rerope", window=37, train_length=TRAIN), 150, 1),
    (ExtensionSettings(method="leaky_rerope", window=20, leaky_k=4.0, log_n=True, train_length=TRAIN), 90, 1),
    (ExtensionSettings(method="ntk_mixed", factor=4.0, train_length=TRAIN), 257, 1),
    (ExtensionSettings(method="rerope", window=50, train_length=TRAIN), 10, 1),
    (ExtensionSettings(method="ntk_mixed", factor=4.0, log_n=True, train_length=TRAIN), 40, 1),  # shares a far table
    (ExtensionSettings(method="yarn", factor=2.0, log_n=True, train_length=TRAIN), 70, 45),
    (ExtensionSettings(method="leaky_rerope", window=33, leaky_k=2.0, train_length=TRAIN), 120, 60),
    # decode rows longer than the kernel's 512-key chunk: chunks on different threads, merged
    (ExtensionSettings(method="rerope", window=40, log_n=True, train_length=TRAIN), 1400, 1),
    (ExtensionSettings(method="leaky_rerope", window=24, leaky_k=8.0, train_length=TRAIN), 1100, 1),
    # prefill near-band shapes: queries inside the window then beyond it, a chunk past a window
    # smaller than the C++ kernel's 32-key tile, windows of 5 and of one token, a chunk inside the window
    (ExtensionSettings(method="rerope", window=37, train_length=TRAIN), 0, 150),
    (ExtensionSettings(method="rerope", window=20, log_n=True, train_length=TRAIN), 30, 50),
    (ExtensionSettings(method="leaky_rerope", window=5, leaky_k=3.0, train_length=TRAIN), 3, 40),
    (ExtensionSettings(method="rerope", window=1, train_length=TRAIN), 0, 12),
    (ExtensionSettings(method="rerope", window=30, train_length=TRAIN), 10, 7),
    # decode rows of every frequency method (one far table each, the query at its true angle)
    (ExtensionSettings(method="none", train_length=TRAIN), 200, 1),
    (ExtensionSettings(method="pi", factor=4.0, train_length=TRAIN), 130, 1),
    (ExtensionSettings(method="ntk_old", factor=8.0, train_length=TRAIN), 99, 1),
    (ExtensionSettings(method="ntk_fixed", factor=4.0, log_n=True, train_length=TRAIN), 180, 1),
    (ExtensionSettings(method="yarn", factor=4.0, train_length=TRAIN), 260, 1),
    # Self-Extend: grouped far positions in decode (past a 512-key chunk; groups as large as the
    # decode kernel's 64-key step) and in prefill, from a cached context and from the start
    (ExtensionSettings(method="self_extend", window=20, group=4, log_n=True, train_length=TRAIN), 300, 1),
    (ExtensionSettings(method="self_extend", window=16, group=64, train_length=TRAIN), 700, 1),
    (ExtensionSettings(method="self_extend", window=24, group=8, train_length=TRAIN), 50, 70),
    (ExtensionSettings(method="self_extend", window=10, group=2, log_n=True, train_length=TRAIN), 0, 90),
    # windows that are no multiple of the group: the rule jumps where m - n = w, so the side
    # each path puts that key on shows
    (ExtensionSettings(method="self_extend", window=10, group=4, train_length=TRAIN), 20, 30),
    (ExtensionSettings(method="self_extend", window=13, group=8, train_length=TRAIN), 400, 1),
    # STRING: the band to the shift at true positions, the far keys at theirs against the query
    # moved back by shift - local; decode past a 512-key chunk, prefill from a cached context and
    # from the start, a local value of 0
    (ExtensionSettings(method="string", shift=21, local=5, log_n=True, train_length=TRAIN), 600, 1),
    (ExtensionSettings(method="string", shift=30, local=12, train_length=TRAIN), 40, 60),
    (ExtensionSettings(method="string", shift=9, local=0, train_length=TRAIN), 0, 80),
    # dual-chunk attention in chunks of 64 (chunk size 74, local window 10; or 64 and 0): decode
    # past a 512-key chunk, decode where the chunk before is still near (offset 3 <= 10) and where
    # it no longer is (offset 40), prefill across chunk edges from a cached context and from the start
    (ExtensionSettings(method="dual_chunk", chunk_size=74, local_window=10, log_n=True, train_length=80), 700, 1),
    (ExtensionSettings(method="dual_chunk", chunk_size=74, local_window=10, train_length=80), 323, 1),
    (ExtensionSettings(method="dual_chunk", chunk_size=74, local_window=10, train_length=80), 232, 1),
    (ExtensionSettings(method="dual_chunk", chunk_size=74, local_window=10, train_length=80), 100, 150),
    (ExtensionSettings(method="dual_chunk", chunk_size=64, local_window=0, log_n=True, train_length=TRAIN), 0, 200),
    # ntk_dynamic: θ steps at TRAIN + j DYNAMIC_STEP (64, 192, 320, ...): a prompt across three
    # steps, a chunk across one, a one-query piece at a step, decode inside training, in a step,
    # and past a 512-key chunk
    (ExtensionSettings(method="ntk_dynamic", train_length=TRAIN), 0, 400),
    (ExtensionSettings(method="ntk_dynamic", log_n=True, train_length=TRAIN), 150, 60),
    (ExtensionSettings(method="ntk_dynamic", train_length=TRAIN), 191, 2),
    (ExtensionSettings(method="ntk_dynamic", train_length=TRAIN), 30, 1),
    (ExtensionSettings(method="ntk_dynamic", log_n=True, train_length=TRAIN), 250, 1),
    (ExtensionSettings(method="ntk_dynamic", train_length=TRAIN), 900, 1),
]


def rows_step(seed=0):
    """A step of ``ROWS`` on a paged cache (rope_plugins/testing/paged_steps.py)."""
    return paged_step(ROWS, seed=seed, head=D, kv=KV, queries_per_kv=QUERIES_PER_KV, block=BLOCK)


def make_step(seed=0):
    """The CPU path's plan of :func:`rows_step`, and its inputs."""
    step = rows_step(seed)
    planner = StepPlanner(block_size=BLOCK)
    meta = planner.plan(step.tables, step.starts, step.seq_lens, step.block_table, step.slots)
    return step.cache, meta, step.sequences, step.query, step.key, step.value, step.starts


@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=needs_compiler), False], ids=["cpp-kernel", "plain"])
def test_step_matches_oracle(use_kernel):
    cache, meta, sequences, query, key, value, starts = make_step()
    impl = RopeExtendAttentionImpl(KV * QUERIES_PER_KV, D, D**-0.5, KV, None, None, "auto")
    impl.use_kernel = use_kernel
    output = torch.empty_like(query)
    impl.forward(None, query, key, value, cache, meta, output)
    torch.testing.assert_close(output, rows_step(seed=0).expected().float(), rtol=0, atol=2e-5)


# A 16-bit step holds exact 16-bit numbers, which both paths widen exactly and compute on in
# float32, as in the float32 test (2e-5); the one new error is the output's rounding to the
# model's dtype: half a unit in its last place, at most 2^-p of the value with p significant
# bits (bfloat16 8, float16 11). A key, value or query taken in 16 bits inside the kernel (or
# a second rounding) adds as much again.
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=needs_compiler), False], ids=["cpp-kernel", "plain"])
def test_16_bit_step_matches_oracle_to_one_rounding(use_kernel, dtype):
    step = paged_step(ROWS, seed=1, head=D, kv=KV, queries_per_kv=QUERIES_PER_KV, block=BLOCK, dtype=dtype)
    meta = StepPlanner(block_size=BLOCK).plan(step.tables, step.starts, step.seq_lens, step.block_table, step.slots)
    impl = RopeExtendAttentionImpl(KV * QUERIES_PER_KV, D, D**-0.5, KV, None, None, "auto")
    impl.use_kernel, impl.rounded_once = use_kernel, False  # float32-grade operands: the output's is the one rounding
    output = torch.empty_like(step.query)
    impl.forward(None, step.query, step.key, step.value, step.cache, meta, output)
    assert output.dtype == dtype
    expected = step.expected()
    torch.testing.assert_close(output.double(), expected, rtol=ROUNDING[dtype], atol=2e-5)
    assert (output.double() - expected).abs().max() > 0  # the output is in 16 bits: rounded, not float32 passed through


# The prefill on AMX tiles (csrc/matrix_tiles.h; and the decode's raw bfloat16 keys by vdpbf16ps) takes each
# float32 operand as two bfloat16 parts, which hold it to 2^-16 (two roundings of 2^-8); with
# the low x low product left out, each product is within about 2^-15 of float32's, against
# 2^-23. Fed float32 queries over a 16-bit cache, the output is not rounded to 16 bits, so the
# float32 test's 2e-5 holds the float32 micro-kernel; the tiles get 2^-14 (6.1e-5: 1.3e-5 to 2.0e-5
# measured here for heads of 32 to 128, at outputs up to 3.4, the products' errors partly cancelling). One
# operand taken as a single bfloat16 (stock vLLM's rounding) is 2^-8 off: the queries' low
# parts left out gave 6.6e-3 here (4.7e-3 in float16; in the decode's tiles, since removed, 1.3e-3).
MATRIX_TILES_TOLERANCE = 2.0**-14


@pytest.mark.parametrize("head", [D, 64, 128], ids=lambda head: f"head{head}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@needs_compiler
@pytest.mark.parametrize("matrix_tiles", [True, False], ids=["amx-tiles", "float32-micro-kernel"])
def test_16_bit_cache_step_matches_oracle_in_float32(matrix_tiles, dtype, head, monkeypatch):
    """Every row of the step, prefill and decode (whose raw bfloat16 keys take vdpbf16ps with or
    without AMX), in head sizes that take each shape of the tile code: one 32-dimension step (D), two
    with the queries kept in tiles (64), and a key tile at a time with two groups of P.V columns (128)."""
    if matrix_tiles and not native.matrix_tiles_ready():
        pytest.skip("no AMX on this CPU (or the kernels were built for another)")
    monkeypatch.setattr(native, "matrix_tiles_ready", lambda: matrix_tiles)
    step, meta, output = float32_output_over_16_bit_cache(dtype, head)
    assert output.dtype == torch.float32 and len(meta.prefill) > 10 and len(meta.decode.seq_lens) > 20
    torch.testing.assert_close(output.double(), step.expected(), rtol=0,
                               atol=MATRIX_TILES_TOLERANCE if matrix_tiles else 2e-5)


def float32_output_over_16_bit_cache(dtype, head, rounded_once=False):
    """The shared step's every row through the impl: float32 queries over a ``dtype`` cache, so
    the output is not rounded to 16 bits. Returns the step, its plan and the output."""
    step = paged_step(ROWS, seed=1, head=head, kv=KV, queries_per_kv=QUERIES_PER_KV, block=BLOCK, dtype=dtype)
    meta = StepPlanner(block_size=BLOCK).plan(step.tables, step.starts, step.seq_lens, step.block_table, step.slots)
    impl = RopeExtendAttentionImpl(KV * QUERIES_PER_KV, head, head**-0.5, KV, None, None, "auto")
    impl.rounded_once = rounded_once
    query = step.query.float()
    output = torch.empty_like(query)
    impl.forward(None, query, step.key, step.value, step.cache, meta, output)
    return step, meta, output


# attention_precision "bfloat16" (stock vLLM's arithmetic): each operand of the bfloat16 dot
# products (AMX tiles; the decode's raw bfloat16 keys by vdpbf16ps) is one bfloat16, 2^-9 of
# itself, so a product is within 2^-8 of float32's. On this step's float32 output (not rounded)
# the tiles measured 7.4e-3 to 9.1e-3 for heads of 32 to 128 at outputs up to 3.5: about what the
# two-part path's own bfloat16 output rounding costs (2^-7 at outputs of 2 to 4); without tiles,
# where only ReRoPE's decode rows take rounded queries, 1.0e-3 to 1.3e-3. Held to 2^-6, and beyond
# 2^-12 (the operands were rounded: two parts give 2e-6 to 2e-5). A float16 cache keeps its two
# parts (cpu.rounded_once_on): bfloat16 would drop 3 of its bits.
ROUNDED_ONCE_TOLERANCE = 2.0**-6


@pytest.mark.parametrize("head", [D, 64, 128], ids=lambda head: f"head{head}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@needs_compiler
@pytest.mark.parametrize("matrix_tiles", [True, False], ids=["amx-tiles", "avx512-bf16-decode"])
def test_operands_rounded_once_match_oracle_to_their_rounding(matrix_tiles, dtype, head, monkeypatch):
    if matrix_tiles and not native.matrix_tiles_ready():
        pytest.skip("no AMX on this CPU (or the kernels were built for another)")
    if not matrix_tiles and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("no AVX512_BF16 on this CPU: no bfloat16 dot products to round for")
    monkeypatch.setattr(native, "matrix_tiles_ready", lambda: matrix_tiles)
    step, _, output = float32_output_over_16_bit_cache(dtype, head, rounded_once=True)
    error = float((output.double() - step.expected()).abs().max())
    if dtype == torch.float16:
        assert error <= MATRIX_TILES_TOLERANCE
    else:
        assert 2.0**-12 < error <= ROUNDED_ONCE_TOLERANCE


def test_the_attention_precision_comes_from_the_engine_config(monkeypatch):
    """The impl reads ``attention_precision`` where vLLM builds it, and refuses a value it does not know."""
    from vllm.config import VllmConfig, set_current_vllm_config

    # vLLM's CPU platform puts PyTorch's libgomp in LD_PRELOAD as it checks a config: not for the rest of the suite
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))

    def impl_under(additional_config):
        with set_current_vllm_config(VllmConfig(additional_config=additional_config)):
            return RopeExtendAttentionImpl(KV * QUERIES_PER_KV, D, D**-0.5, KV, None, None, "auto")

    assert impl_under({PRECISION_KEY: "bfloat16"}).rounded_once and impl_under({}).rounded_once  # the default
    assert not impl_under({PRECISION_KEY: "float32"}).rounded_once
    with pytest.raises(ValueError, match=PRECISION_KEY):
        impl_under({PRECISION_KEY: "fp8"})


@needs_compiler
def test_the_kernel_is_built_to_run_its_chunks_in_parallel():
    """Without OpenMP at build time ATen's parallel_for runs every chunk on one core."""
    assert b"GOMP_parallel" in Path(native.kernels().__file__).read_bytes()


def test_plain_prefill_in_chunks_of_a_few_queries_matches_oracle():
    """The plain prefill's query chunks (3 to 5 queries each here) change nothing."""
    cache, meta, _, query, _, _, _ = make_step()
    expected = rows_step(seed=0).expected().float()
    for row in meta.prefill:
        heads = KV * QUERIES_PER_KV
        out = cpu.prefill_plain(query[row.tokens], meta.query, cache, meta.block_table[row.row], row, scale=D**-0.5,
                                scores_per_chunk=heads * row.seq_len * (3 + row.row % 3))
        torch.testing.assert_close(out, expected[row.tokens], rtol=0, atol=2e-5)


@needs_compiler
def test_kernels_whose_tiles_disagree_with_the_planner_do_not_load(monkeypatch):
    """csrc/attention_inputs.h's key tile is the planner's KEY_TILE; a mismatch stops the load."""
    cpu.built_kernels.cache_clear()
    monkeypatch.setattr(cpu, "KEY_TILE", 16)
    with pytest.raises(native.KernelBuildError, match="KEY_TILE"):
        cpu.built_kernels()
    cpu.built_kernels.cache_clear()


@needs_compiler
def test_kernel_equals_plain_decode():
    cache, meta, _, query, _, _, _ = make_step(seed=3)
    decode_query = query[meta.decode.tokens]
    fast = cpu.decode(decode_query, cache, meta.decode, meta.query, scale=D**-0.5)
    reference = cpu.decode_plain(decode_query, cache, meta.decode, meta.query, scale=D**-0.5)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-5)


# Head shapes of real models for the C++ decode, each a different grouping in csrc/decode_vector.h:
# (head size, query heads per kv head): 64 with 7 (Qwen2.5 0.5B: P.V in groups of 4 and 3), 128
# with 4 (Llama 3: groups of 2), 256 with 2 (Gemma 3: one at a time), 80 with 2 (groups of 3, a
# head size no power of two).
HEAD_SHAPES = [(64, 7), (128, 4), (256, 2), (80, 2)]
DECODE_ROWS = [row for row in ROWS if row[2] == 1]


@needs_compiler
@pytest.mark.parametrize("head,queries_per_kv", HEAD_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kernel_decode_of_real_head_shapes_matches_oracle(head, queries_per_kv, dtype):
    step = paged_step(DECODE_ROWS, seed=4, head=head, kv=KV, queries_per_kv=queries_per_kv, block=BLOCK, dtype=dtype)
    plan = StepPlanner(block_size=BLOCK).plan(step.tables, step.starts, step.seq_lens, step.block_table, step.slots)
    output = cpu.decode(step.query, step.cache, plan.decode, plan.query, scale=head**-0.5)
    torch.testing.assert_close(output.double(), step.expected(), rtol=ROUNDING.get(dtype, 0), atol=2e-5)


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_kernels_built_for_other_cpus_match_the_oracle(march):
    """An image built for other CPUs compiles other loops than this machine's build: for
    ``ROPE_EXTEND_MARCH=x86-64-v3`` (AVX2, no AVX-512) the kernels' portable loops instead of their
    AVX-512 ones (csrc/micro_gemm.h, csrc/decode_vector.h); for ``skylake-avx512`` (AVX-512 without
    AVX512_BF16) the decode's widened scoring of raw bfloat16 keys instead of vdpbf16ps. This
    file's kernel tests against the oracle pass on each build too, in float32, bfloat16 and float16,
    and the fp8 cache's (tests/ops/test_fp8_cache.py, every fp8 code read back bit for bit too)."""
    env = {**os.environ, native.MARCH_ENV: march}
    load = "from rope_plugins.ops import native; print(native.kernels().__file__)"
    built = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0 and march.replace("-", "_") in built.stdout, built.stderr[-2000:]
    fp8 = str(Path(__file__).parent.parent / "ops" / "test_fp8_cache.py")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, fp8, "-k",
                            "(matches_oracle or matches_the_oracle or every_fp8_code) and not plain and not chunked"],
                           env=env,
                           capture_output=True, text=True, timeout=900)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


@needs_compiler
def test_kernels_load_past_a_lock_left_by_a_killed_build():
    """A build stopped midway (Ctrl-C, an install's timeout) leaves PyTorch's ``lock`` file in the
    build folder, and PyTorch alone would wait for it forever at every later start: the kernels
    still load, and the leftover is gone."""
    native.kernels()  # built (and cached) before the leftover appears
    leftover = native.build_directory(f"rope_plugins_kernels_{native.MARCH.replace('-', '_')}") / "lock"
    leftover.touch()
    load = "from rope_plugins.ops import native; print(native.kernels().__file__)"
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and "rope_plugins_kernels" in loaded.stdout, loaded.stderr[-2000:]
    assert not leftover.exists()


@needs_compiler
def test_a_fresh_process_on_the_engines_plain_path_loads_the_kernels_without_a_build(tmp_path):
    """The install builds the kernels; the engine, started without the venv on its PATH (``make
    run``), must load them as they are. A ninja of another version first on that PATH (a system
    one; here a stand-in that only says it ran) would find the build log foreign and compile
    everything again, for minutes, before the engine is up."""
    native.kernels()
    name = f"rope_plugins_kernels_{native.MARCH.replace('-', '_')}"
    directory = native.build_directory(name)
    built = [(directory / f"{name}.so").stat().st_mtime_ns, (directory / ".ninja_log").read_text()]
    other_ninja = tmp_path / "ninja"
    other_ninja.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\nexit 1\n")
    other_ninja.chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(tmp_path), "/usr/local/bin", "/usr/bin", "/bin"])}
    load = "from rope_plugins.ops import native; print(native.kernels().__file__)"
    loaded = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and name in loaded.stdout, loaded.stderr[-2000:]
    assert [(directory / f"{name}.so").stat().st_mtime_ns, (directory / ".ninja_log").read_text()] == built
    assert not (tmp_path / "ran").exists()


def test_merge_of_parts_equals_one_softmax_and_survives_a_query_with_no_keys():
    generator = torch.Generator().manual_seed(5)
    scores, values = torch.randn(3, 10, generator=generator), torch.randn(10, 4, generator=generator)
    scores[2] = float("-inf")  # a padded query: no key in any part
    parts = [(0, 4), (4, 10)]
    outs = [torch.nan_to_num(scores[:, a:b].softmax(-1)) @ values[a:b] for a, b in parts]
    lses = [scores[:, a:b].logsumexp(-1) for a, b in parts]
    merged, lse = merge_partials(outs, lses)
    torch.testing.assert_close(merged[:2], scores[:2].softmax(-1) @ values)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    assert torch.equal(merged[2], torch.zeros(4)) and lse[2] == float("-inf")


@needs_compiler
@pytest.mark.parametrize("heads_outer", [True, False], ids=["kv-heads-outer", "tokens-outer"])
def test_kernel_cache_write_equals_pytorch_and_skips_padding(heads_outer):
    """The C++ write puts each token's key and value where the PyTorch one does, on either
    cache layout vLLM may hand over, and leaves the slots of padding tokens (-1) alone."""
    generator = torch.Generator().manual_seed(7)
    blocks, block_size, tokens = 6, BLOCK, 40
    key, value = torch.randn(2, tokens, KV, D, generator=generator)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    shape = (blocks, KV, block_size, 2 * D) if heads_outer else (blocks, block_size, KV, 2 * D)
    caches = []
    for use_kernel in (True, False):
        storage = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        cache = storage if heads_outer else storage.transpose(1, 2)
        cpu.write_cache(key, value, cache, slots, use_kernel=use_kernel)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    before = caches[0].clone()
    padded = slots.clone()
    padded[::2] = -1
    cpu.write_cache(key * 2, value * 2, caches[0], padded)
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[slots[1::2]] = True
    written = written.view(blocks, 1, block_size, 1).expand_as(before)
    assert torch.equal(caches[0][~written], before[~written])
    assert not torch.equal(caches[0][written], before[written])
