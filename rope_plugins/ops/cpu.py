"""The attention's CPU ops on the pre-rotation paged cache.

Prefill rows take the C++ one-pass kernel (:func:`prefill_kernel`: keys rotated once per chunk
and laid out in tiles, then near, far and straddling tiles in one walk). Decode rows are batched
together in one call of the C++ decode (:mod:`rope_plugins.ops.native`). Both read a float32,
bfloat16 or float16 cache and compute in float32 (16-bit keys and values are widened exactly as
they are read; the output is rounded once, to the model's dtype).

Without a C++ compiler plain PyTorch computes the same rule in float32:
:func:`prefill_plain` and :func:`decode_plain` score every key a query sees at its near and
far angle and pick by distance. The float64 oracle holds both paths in the tests.

An fp8 cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``) holds each key and value
divided by its layer's scale and rounded as stock vLLM's CPU cache rounds them
(:func:`quantized`); reading multiplies the scale back (:class:`CacheScales`). Keys are cached
unrotated, so the quantization never sees a position. The C++ kernels read fp8 elements as they
read 16-bit ones, widened exactly, and take the scales where they cost nothing: the key's into
the softmax scale (``q . (s k) = s (q . k)``), the value's into the output, before its one rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from rope_plugins.attention.planner import DECODE_FAR_STEP, KEY_TILE, DecodePlan, PrefillRow, QueryPlan
from rope_plugins.ops import native
from rope_plugins.plugin import FP8_CACHE_DTYPES
from rope_plugins.rules.rotary import rotate_by

# the format each fp8 cache holds (vLLM allocates it as bytes)
FP8_FORMATS = dict(zip(FP8_CACHE_DTYPES, (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)))


@dataclasses.dataclass(frozen=True)
class CacheScales:
    """What a cached key and value are multiplied by when read (an fp8 cache's per-tensor scales,
    the layer's ``k_scale`` and ``v_scale``; 1 for any other cache)."""

    key: float = 1.0
    value: float = 1.0


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in FP8_FORMATS.values()


def keys_and_values(rows: torch.Tensor, scales: CacheScales) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows ``[..., 2d]`` split into their keys and values; an fp8 cache's in float32, times ``scales``."""
    head_dim = rows.shape[-1] // 2
    keys, values = rows[..., :head_dim], rows[..., head_dim:]
    if is_fp8(rows):
        return keys.float() * scales.key, values.float() * scales.value
    return keys, values


def quantized(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in the fp8 ``dtype`` as stock vLLM 0.32's CPU cache writes it: in float32,
    saturated at the format's largest finite value, rounded toward zero (its writes match this
    bit for bit: tests/ops/test_fp8_cache.py)."""
    largest = torch.finfo(dtype).max
    exact = (x.float() / scale).clamp(-largest, largest)
    nearest = exact.to(dtype)
    bits = nearest.view(torch.uint8)
    # round to nearest, then one step toward zero where that went past x (never past zero: the
    # magnitude's bits count up from it)
    away = (nearest.float().abs() > exact.abs()) & (bits & 0x7F > 0)
    return torch.where(away, bits - 1, bits).view(dtype)


@functools.cache
def built_kernels():
    """The C++ kernels' module (:func:`native.kernels`; None without a compiler), checked once
    against the planner: the C++ key tile is its ``KEY_TILE``, and the decode's chunk holds
    whole far steps (``DECODE_FAR_STEP``) as its walk of the far angles needs."""
    module = native.kernels()
    if module is not None and (module.KEY_TILE != KEY_TILE or module.DECODE_CHUNK % DECODE_FAR_STEP):
        raise native.KernelBuildError(f"csrc/attention_inputs.h (KEY_TILE {module.KEY_TILE}, DECODE_CHUNK "
                                      f"{module.DECODE_CHUNK}) disagrees with the planner (KEY_TILE {KEY_TILE}, "
                                      f"DECODE_FAR_STEP {DECODE_FAR_STEP})")
    return module


def rotated_queries(query: torch.Tensor, plan: QueryPlan, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled query of ``tokens`` rotated to its near and its far angle."""
    scaled = query * plan.scale[tokens, None, None]
    near, far = plan.near[tokens], plan.far[tokens]
    return rotate_by(scaled, near.cos, near.sin), rotate_by(scaled, far.cos, far.sin)


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                use_kernel: bool = True, scales: CacheScales = CacheScales()) -> None:
    """Unrotated keys and values into their slots: kv_cache ``[blocks, kv_heads, block, 2d]``
    (one C++ call where it is built; an fp8 cache's, :func:`quantized` by ``scales``)."""
    if use_kernel and built_kernels() is not None:
        native.write_cache(key=key, value=value, kv_cache=kv_cache, slots=slot_mapping, key_scale=scales.key,
                           value_scale=scales.value)
        return
    if is_fp8(kv_cache):  # fp8 has no index_put: the quantized bytes are written
        key = quantized(key, scales.key, kv_cache.dtype).view(torch.uint8)
        value = quantized(value, scales.value, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    kv_cache[slots // block_size, :, slots % block_size] = torch.cat((key, value), dim=-1)


def sequence_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                  scales: CacheScales = CacheScales()) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's unrotated keys and values, ``[seq_len, kv, d]`` each (an fp8 cache's in
    float32, times ``scales``)."""
    blocks = kv_cache[block_ids[: -(-seq_len // kv_cache.shape[2])]]  # [nb, kv, bs, 2d]
    cached = blocks.transpose(1, 2).reshape(-1, kv_cache.shape[1], kv_cache.shape[3])[:seq_len]
    return keys_and_values(cached, scales)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the model dtypes the C++ kernels serve
KERNEL_CACHE_DTYPES = (*KERNEL_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)  # the caches they read


def scaled_output(output: torch.Tensor, scales: CacheScales, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's float32 output times the value scale (an fp8 cache's; 1 otherwise), rounded once to ``dtype``."""
    return (output * scales.value if scales.value != 1.0 else output).to(dtype)


def uses_matrix_tiles(model_dtype: torch.dtype) -> bool:
    """A 16-bit model's prefill takes AMX tiles where the CPU has them, as stock vLLM's attention
    does in bfloat16 (float32 stays on the float32 micro-kernel, whatever its cache holds: an fp8
    cache's keys, turned, are no more bfloat16 than float32's). The decode does not: its raw
    bfloat16 keys on tiles scored faster with the cache in L2 but read a real step's cache from
    memory slower than vdpbf16ps in vector registers (docs/design.md)."""
    return model_dtype != torch.float32 and native.matrix_tiles_ready()


def rounded_once_on(kv_cache: torch.Tensor, rounded_once: bool, model_dtype: torch.dtype | None = None) -> bool:
    """Whether the bfloat16 dot products take their operands rounded once to bfloat16, as asked:
    over a bfloat16 cache (the decode's vdpbf16ps reads its raw keys); and, for the prefill's AMX
    tiles, whose keys are turned in float32 whatever the cache holds (``model_dtype`` given),
    over a bfloat16 model's fp8 cache too. Never a float16 model's: bfloat16 would drop 3 of its bits."""
    return rounded_once and (kv_cache.dtype == torch.bfloat16 or (model_dtype == torch.bfloat16 and is_fp8(kv_cache)))


def uses_prefill_kernel(query: torch.Tensor) -> bool:
    """The C++ prefill serves head sizes in whole key tiles, where it is built."""
    return (query.dtype in KERNEL_DTYPES and query.shape[-1] % KEY_TILE == 0
            and built_kernels() is not None)


def prefill_kernel(query: torch.Tensor, queries: QueryPlan, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   row: PrefillRow, *, scale: float, matrix_tiles: bool | None = None,
                   rounded_once: bool = False, scales: CacheScales = CacheScales()) -> torch.Tensor:
    """One request's chunk in one pass of the C++ kernel, from the row's unrotated queries
    ``[L, heads, d]`` (the kernel scales and turns them as it reads them) and the paged cache:
    its keys read out once per chunk at their far angle (raw under ReRoPE) and, for the band, at
    their near angle, in tiles whose 32 keys of one dimension are one contiguous vector. On AMX
    tiles where :func:`uses_matrix_tiles` (``matrix_tiles`` None) or where asked, their operands
    rounded once to bfloat16 where ``rounded_once`` (:func:`rounded_once_on`; else two bfloat16 parts
    each, to 2^-16). An fp8 cache's ``scales`` fold into the softmax scale and the output."""
    tile, half = KEY_TILE, query.shape[-1] // 2
    tiles = -(-row.seq_len // tile)
    flat = lambda angles: angles.reshape(-1, half)  # noqa: E731
    far_cos, far_sin = (flat(row.far_keys.cos), flat(row.far_keys.sin)) if row.far_keys is not None else (None, None)
    far_keys = native.cache_key_tiles(kv_cache=kv_cache, block_ids=block_ids, first=0, count=row.seq_len,
                                      cos=far_cos, sin=far_sin, origin=0, tiles=tiles)
    near_origin, near_keys = 0, kv_cache.new_empty(0)
    if row.band_keys is not None:
        near_origin = row.band_start // tile * tile
        near_keys = native.cache_key_tiles(kv_cache=kv_cache, block_ids=block_ids, first=row.band_start,
                                           count=row.seq_len - row.band_start, cos=flat(row.band_keys.cos),
                                           sin=flat(row.band_keys.sin), origin=near_origin,
                                           tiles=tiles - near_origin // tile)
    near, far = queries.near[row.tokens], queries.far[row.tokens]
    matrix_tiles = uses_matrix_tiles(query.dtype) if matrix_tiles is None else matrix_tiles
    inputs = native.prefill_inputs(query_scale=queries.scale[row.tokens], near_cos=flat(near.cos),
                                   near_sin=flat(near.sin), far_cos=flat(far.cos), far_sin=flat(far.sin),
                                   near_from=row.near_from, context=row.context, banded=row.band_keys is not None,
                                   near_origin=near_origin, matrix_tiles=matrix_tiles,
                                   rounded_once=rounded_once_on(kv_cache, rounded_once, query.dtype))
    output = native.prefill_attention(
        inputs, query=query.float(), near_keys=near_keys, far_keys=far_keys,
        values=native.cache_values(kv_cache=kv_cache, block_ids=block_ids, seq_len=row.seq_len),
        scale=scale * scales.key)
    return scaled_output(output, scales, query.dtype)


def prefill(query: torch.Tensor, queries: QueryPlan, kv_cache: torch.Tensor, block_ids: torch.Tensor,
            row: PrefillRow, *, scale: float, use_kernel: bool = True, rounded_once: bool = False,
            scales: CacheScales = CacheScales()) -> torch.Tensor:
    """One request's chunk from its unrotated queries ``[L, heads, d]``: the C++ kernel where it
    serves them (:func:`uses_prefill_kernel`; ``rounded_once``: its AMX tiles' operands), else
    :func:`prefill_plain` (an fp8 cache's, read times ``scales``, in either)."""
    if use_kernel and uses_prefill_kernel(query):
        return prefill_kernel(query, queries, kv_cache, block_ids, row, scale=scale, rounded_once=rounded_once,
                              scales=scales)
    return prefill_plain(query, queries, kv_cache, block_ids, row, scale=scale, scales=scales)


PLAIN_SCORES = 1 << 24  # score entries per query chunk of the plain prefill (it holds a near and a far matrix)


def prefill_plain(query: torch.Tensor, queries: QueryPlan, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                  row: PrefillRow, *, scale: float, scores_per_chunk: int = PLAIN_SCORES,
                  scales: CacheScales = CacheScales()) -> torch.Tensor:
    """:func:`prefill_kernel` in plain PyTorch (float32 scores): per chunk of queries, every
    score at its far angle, the near band's at its near angle, the rule's pick from each
    query's first near key, the causal mask and one softmax. The fallback where
    no C++ compiler is, or for other dtypes; the oracle holds it in the tests."""
    keys, values = sequence_keys(kv_cache, block_ids, row.seq_len, scales)
    near_query, far_query = rotated_queries(query, queries, row.tokens)
    far_keys = rotate_by(keys, row.far_keys.cos, row.far_keys.sin) if row.far_keys is not None else keys
    band_keys = None
    if row.band_keys is not None:
        band_keys = rotate_by(keys[row.band_start:], row.band_keys.cos, row.band_keys.sin)
    key_positions = torch.arange(row.seq_len)
    per_chunk = max(1, scores_per_chunk // (query.shape[1] * row.seq_len))
    outputs = []
    for first in range(0, row.chunk, per_chunk):
        part = slice(first, first + per_chunk)
        distance = (row.context + torch.arange(row.chunk)[part])[:, None] - key_positions  # [l, S]
        scores = gqa_scores(far_query[part], far_keys)  # [kv, g, l, S]
        if band_keys is not None:
            band = scores[..., row.band_start:]
            band.copy_(torch.where(key_positions[row.band_start:] >= row.near_from[part, None],
                                   gqa_scores(near_query[part], band_keys), band))
        weights = torch.softmax((scores * scale).masked_fill(distance < 0, float("-inf")), dim=-1)
        outputs.append(torch.einsum("kgls,skd->lkgd", weights, values.float()).flatten(1, 2))
    return torch.cat(outputs).to(query.dtype)


def gqa_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Float32 scores of queries ``[l, H, d]`` against keys ``[S, kv, d]``: ``[kv, H / kv, l, S]``."""
    length, heads, d = query.shape
    kv = keys.shape[1]
    return torch.einsum("lkgd,skd->kgls", query.float().view(length, kv, heads // kv, d), keys.float())


def decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, queries: QueryPlan, *, scale: float,
           use_kernel: bool = True, rounded_once: bool = False, scales: CacheScales = CacheScales()) -> torch.Tensor:
    """All decode rows at once from their unrotated queries ``[Rd, heads, d]``: the C++ kernel
    (it reads the paged cache in place and rotates as it goes; ``rounded_once``: the far queries
    rounded once against raw bfloat16 keys), else :func:`decode_plain` (an fp8 cache's, read
    times ``scales``, in either)."""
    if not (use_kernel and kv_cache.dtype in KERNEL_CACHE_DTYPES and built_kernels() is not None):
        return decode_plain(query, kv_cache, plan, queries, scale=scale, scales=scales)
    output = native.decode_attention(plan.kernel_inputs, query=query.float(), kv_cache=kv_cache,
                                     scale=scale * scales.key, rounded_once=rounded_once_on(kv_cache, rounded_once))
    return scaled_output(output, scales, query.dtype)


def decode_plain(query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, queries: QueryPlan, *,
                 scale: float, scales: CacheScales = CacheScales()) -> torch.Tensor:
    """All decode rows at once, block by block of the paged cache, in float32: ``[Rd, heads, d]``."""
    rows, heads, d = query.shape
    near_query, far_query = rotated_queries(query.float(), queries, plan.tokens)
    keys, values = keys_and_values(kv_cache[plan.block_ids], scales)  # [Rd, nb, kv, bs, d]: one copy of the cache
    keys, values = keys.float(), values.float()
    _, num_blocks, kv, block_size, _ = keys.shape
    queries_per_kv = heads // kv
    if plan.far_keys is not None:  # rows with ρ = 0 take the identity rotation
        table = plan.far_keys.table_of_row.clamp(min=0)
        identity = (plan.far_keys.table_of_row < 0)[:, None, None]
        rotation = plan.far_keys.rotation
        cos = torch.where(identity, 1.0, rotation.cos[table]).view(rows, num_blocks, 1, block_size, -1)
        sin = torch.where(identity, 0.0, rotation.sin[table]).view(rows, num_blocks, 1, block_size, -1)
        far_keys = rotate_by(keys, cos, sin)
    else:
        far_keys = keys  # ReRoPE: old keys are read raw
    # [Rd, nb, kv, g, bs]
    scores = torch.matmul(far_query.view(rows, 1, kv, queries_per_kv, d), far_keys.transpose(-1, -2))
    scores = scores.permute(0, 2, 3, 1, 4).reshape(rows, kv, queries_per_kv, num_blocks * block_size)
    if plan.band is not None:
        band = plan.band
        band_keys = rotate_by(keys[torch.arange(rows)[:, None], band.block, :, band.offset], band.keys.cos,
                              band.keys.sin)  # [Rd, W, kv, d]
        band_scores = torch.einsum("rkgd,rwkd->rkgw", near_query.view(rows, kv, queries_per_kv, d), band_keys)
        scores = torch.cat((scores, scores.new_zeros(rows, kv, queries_per_kv, 1)), dim=-1)
        scores.scatter_(-1, band.target[:, None, None, :].expand_as(band_scores), band_scores)
        scores = scores[..., :-1]
    scores = (scores * scale).masked_fill(~plan.keep[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = weights.view(rows, kv, queries_per_kv, num_blocks, block_size).permute(0, 3, 1, 2, 4)
    output = torch.matmul(weights, values).sum(dim=1)  # [Rd, kv, g, d] summed over blocks
    return output.reshape(rows, heads, d).to(query.dtype)
