"""The Triton kernels (rope_plugins/ops/gpu.py) against the float64 oracle, on this CPU under
Triton's interpreter: every method with and without log-n, decode and prefill rows mixed in one
launch, GQA 3:1 and 7:1, head sizes 64, 128, 256 and 96 (pairs padded to a power of two),
float32 (IEEE dots) and float16 (the interpreter's bfloat16 dots are not trustworthy). Then
what the interpreter cannot show: that Triton compiles them for a GPU, and their contract
(labelled parameter groups in one order)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_plugins.attention.planner import DECODE_KEY_TILE, kernel_plan
from rope_plugins.ops import gpu
from rope_plugins.rules.settings import METHOD_NAMES, ExtensionSettings
from rope_plugins.testing.paged_steps import nearest_fp8
from tests.attention.test_attention import TRAIN, paged_step

WINDOWED = {"rerope": dict(window=37), "leaky_rerope": dict(window=20, leaky_k=4.0),
            "self_extend": dict(window=20, group=4), "string": dict(shift=25, local=6),
            "dual_chunk": dict(chunk_size=64, local_window=0)}
FACTORS = {"pi": 4.0, "ntk_old": 8.0, "ntk_fixed": 4.0, "ntk_mixed": 4.0, "yarn": 4.0}


def settings(method: str, log_n: bool, **fields) -> ExtensionSettings:
    chosen = {**WINDOWED.get(method, {}), **fields}
    if method in FACTORS:
        chosen.setdefault("factor", FACTORS[method])
    return ExtensionSettings(method=method, log_n=log_n, **{"train_length": TRAIN, **chosen})


def every_method_rows(context: int, new: int) -> list:
    """Each method with and without log-n, ``context`` cached tokens and ``new`` this step."""
    return [(settings(method, log_n), context + 7 * i, new)
            for i, (method, log_n) in enumerate((name, with_log_n) for name in METHOD_NAMES if name != "auto"
                                                for with_log_n in (False, True))]


# Prefill rows: a window (37) no multiple of the tiles (16 queries, 32 keys); a chunk starting
# inside the window with the window's edge inside a tile (straddling tiles at the chunk's
# start); a one-token window; a first chunk; decode rows between them in the same launch.
MIXED_ROWS = [
    (settings("rerope", False), 0, 50),
    (settings("leaky_rerope", True, window=20, leaky_k=3.0), 30, 40),
    (settings("rerope", True, window=1), 5, 20),
    (settings("ntk_mixed", False), 130, 1),
    (settings("yarn", True, factor=2.0), 20, 35),
    (settings("leaky_rerope", False, window=24, leaky_k=8.0), 100, 1),
    (settings("none", False), 0, 18),
    (settings("self_extend", True, window=12, group=8), 40, 30),
    (settings("string", False, shift=19, local=3), 25, 30),
    # dual-chunk in chunks of 64 (local window 10): a prefill across two chunk edges, a decode
    # row whose chunk before is still near
    (settings("dual_chunk", True, chunk_size=74, local_window=10, train_length=80), 50, 100),
    (settings("dual_chunk", False, chunk_size=74, local_window=10, train_length=80), 133, 1),
    # ntk_dynamic's θ steps at 64 and 192 inside these chunks: cut into rows of one θ each
    (settings("ntk_dynamic", True), 0, 70),
    (settings("ntk_dynamic", False), 170, 40),
]


def run_kernels(step, *, query_tile=16, min_split_keys=DECODE_KEY_TILE, decode_launch=None, cache=None,
                scales=None) -> torch.Tensor:
    """The step through prefill and decode (on ``cache`` where given: an fp8 one, with its ``scales``)."""
    plan = kernel_plan(step.tables, query_start_cpu=step.starts, query_start=step.starts.to(torch.int32),
                       seq_lens=step.seq_lens.to(torch.int32), max_seq_len=int(step.seq_lens.max()),
                       block_table=step.block_table.to(torch.int32), slot_mapping=step.slots, query_tile=query_tile,
                       min_split_keys=min_split_keys)
    output = torch.full_like(step.query, float("nan"))
    head = step.query.shape[-1]
    scale = head**-0.5
    cache, scaled = (step.cache if cache is None else cache), {} if scales is None else dict(
        key_scale=scales.key, value_scale=scales.value)
    gpu.prefill(step.query, cache, plan, output, scale=scale, **scaled)
    gpu.decode(step.query, cache, plan, output, scale=scale, **(decode_launch or {}), **scaled)
    return output


TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2}


def assert_matches_oracle(step, dtype, **launch):
    output = run_kernels(step, **launch)
    torch.testing.assert_close(output.double(), step.expected().double(), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_every_method_with_and_without_log_n(dtype):
    """Rows of 40-145 keys in splits of 64: rows span several splits and end mid-split."""
    step = paged_step(every_method_rows(40, 1), seed=1, head=64, kv=2, queries_per_kv=3, dtype=dtype)
    assert_matches_oracle(step, dtype)


@pytest.mark.parametrize("launch", [dict(dot=False, tile_angles=False), dict(tile_angles=False),
                                    dict(dot=False, tile_angles=True), dict(key_tile=32), dict(key_tile=128)],
                         ids=["broadcast-sums", "key-angles", "broadcast-sums-tile-angles", "key-tile-32",
                              "key-tile-128-splits-of-64"])
def test_decode_launch_choices_every_method(launch):
    """The decode's other launches (bench/gpu_kernel_speed.py times them): float32 broadcast sums
    instead of ``tl.dot``, each key's own angle instead of the tile's angle sums (dual-chunk's
    chunks of 64 hold whole tiles), a smaller key tile, and a larger one than the splits of 64
    hold whole (its keys then turned one by one)."""
    step = paged_step(every_method_rows(40, 1), seed=1, head=64, kv=2, queries_per_kv=3, dtype=torch.float32)
    assert_matches_oracle(step, torch.float32, decode_launch=launch)


@pytest.mark.slow  # 6-8 s each in the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prefill_every_method_with_and_without_log_n(dtype):
    step = paged_step(every_method_rows(20, 24), seed=2, head=64, kv=2, queries_per_kv=3, dtype=dtype)
    assert_matches_oracle(step, dtype)


@pytest.mark.parametrize(("head", "kv", "queries_per_kv"), [(64, 2, 3), (128, 1, 7), (256, 1, 2), (96, 2, 1)],
                         ids=["d64-gqa3", "d128-gqa7", "d256", "d96-pairs-padded"])
def test_mixed_prefill_and_decode_rows_in_one_step(head, kv, queries_per_kv):
    step = paged_step(MIXED_ROWS, seed=3, head=head, kv=kv, queries_per_kv=queries_per_kv, block=16)
    assert_matches_oracle(step, torch.float32)


def test_cache_write_skips_padded_slots():
    step = paged_step(MIXED_ROWS[:3], seed=4, head=64, kv=2, queries_per_kv=3)
    slots = step.slots.clone()
    slots[::5] = -1  # padded tokens: nothing written for them
    cache = torch.zeros_like(step.cache)
    gpu.write_cache(step.key, step.value, cache, slots)
    expected = torch.zeros_like(step.cache)
    written = slots >= 0
    block_size = cache.shape[2]
    kept = slots[written]
    expected[kept // block_size, :, kept % block_size] = torch.cat((step.key, step.value), -1)[written]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_fp8_cache_write_rounds_to_nearest_and_saturates_bit_for_bit(name):
    """Every magnitude from far below fp8's subnormals to past its largest value, each format's own
    values and the midpoints between them (ties to even), both zeros: the kernel stores what
    PyTorch's conversion to fp8 (round to nearest even) stores of the value saturated and divided
    by its scale, as vLLM's CUDA cache writes fp8."""
    from tests.ops.test_fp8_cache import FORMATS, SCALES

    fp8 = FORMATS[name]
    generator = torch.Generator().manual_seed(5)
    held = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    held = held[held.isfinite()].unique()
    values = torch.cat((torch.randn(4000, generator=generator) * torch.randint(-24, 20, (4000,),
                                                                                 generator=generator).float().exp2(),
                        held, (held[:-1] + held[1:]) / 2, torch.tensor([1e9, -1e9, 0.0, -0.0])))
    values = values[: values.numel() // 64 * 64].reshape(-1, 1, 64)
    tokens = values.shape[0]
    cache = torch.zeros(-(-tokens // 16), 1, 16, 128, dtype=fp8)
    gpu.write_cache(values * SCALES.key, values * SCALES.value, cache, torch.arange(tokens), key_scale=SCALES.key,
                    value_scale=SCALES.value)
    written = cache.transpose(1, 2).reshape(-1, 1, 128)[:tokens]
    for half, scale in ((written[..., :64], SCALES.key), (written[..., 64:], SCALES.value)):
        expected = nearest_fp8(values * scale, scale, fp8)
        assert torch.equal(half.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(("name", "dtype"), [("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.float32),
                                             ("fp8_e4m3", torch.float16)], ids=["e4m3-fp32", "e5m2-fp32", "e4m3-fp16"])
def test_every_method_on_an_fp8_cache_matches_the_oracle_on_its_values(name, dtype):
    """Prefill and decode rows of every method on a cache of fp8 keys and values (divided by
    scales that are no power of two): the oracle run on the values that cache holds, to the
    model dtype's tolerance. The kernels widen fp8 exactly and fold the scales into the softmax
    scale and the output, which moves only float32 roundings."""
    from tests.ops.test_fp8_cache import FORMATS, SCALES, fp8_step

    step, cache, oracle = fp8_step(name, paged_step(MIXED_ROWS, seed=3, head=64, kv=2, queries_per_kv=3, block=16,
                                                    dtype=dtype))
    output = run_kernels(step, cache=cache.view(FORMATS[name]), scales=SCALES)
    torch.testing.assert_close(output.double(), oracle.expected().double(), rtol=0, atol=TOLERANCE[dtype])


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute: Triton's compiler and ptxas, twice per kernel and dtype
def test_every_kernel_compiles_for_a_gpu():
    """The interpreter runs code a GPU compile refuses; here each kernel, as the wrappers launch
    it in float32, float16 and bfloat16, goes through Triton's compiler and ptxas for Hopper and
    Ampere, and on fp8 caches (e4m3 under bfloat16, e5m2 under float16) for Hopper."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.ops.compile_kernels", "sm_90", "sm_80"], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = {tuple(line.split()[:3]): line for line in result.stdout.splitlines()}
    kernels = {"write_cache_kernel", "prefill_kernel", "decode_split_kernel", "decode_reduce_kernel"}
    fp8 = {(kernel, dtype, "sm_90:") for kernel in kernels - {"decode_reduce_kernel"}
           for dtype in ("bfloat16/fp8_e4m3", "float16/fp8_e5m2")}
    assert set(lines) == fp8 | {(kernel, dtype, target) for kernel in kernels
                                for dtype in ("float32", "float16", "bfloat16") for target in ("sm_90:", "sm_80:")}
    # the fp8 write divides by the scale as IEEE does (vLLM's CUDA write); a GPU's plain division is approximate
    assert all(lines[("write_cache_kernel", dtype, "sm_90:")].endswith(" 0 approximate divisions")
               for _, dtype, _ in fp8)


PARAMETER_GROUPS = ["outputs", "inputs", "the paged cache", "the step's rows", "the row rule", "strides",
                    "constexpr sizes"]


@pytest.mark.parametrize("kernel", ["prefill_kernel", "decode_split_kernel"])
def test_the_attention_kernels_label_their_parameter_groups_in_one_order(kernel):
    signature = re.search(rf"def {kernel}\((.*?)\n\):", Path(gpu.__file__).read_text(), re.DOTALL).group(1)
    assert re.findall(r"^    # ([^\n]+)$", signature, re.MULTILINE) == PARAMETER_GROUPS
    assert re.findall(r"\w*group\w*", signature, re.IGNORECASE) == ["group_ptr"]  # Self-Extend's; GQA: QUERIES_PER_KV
