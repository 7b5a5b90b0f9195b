"""The attention's Triton kernels on the pre-rotation paged cache (vLLM's CUDA build).

Each row's rule comes as numbers, not tables (:class:`KernelPlan`): its frequencies ``θ``
(float64), window ``w``, leak ``ρ``, far origin ``o`` (``w`` but in STRING), Self-Extend's
group ``g`` (far positions floored to groups; 0: none), log-n length, query factor and
dual-chunk attention's chunk length ``s`` (0: none; far keys at ``n mod s``, the far query at
``o``, and the window following the query, :func:`query_window`). Angles
are formed in float64 inside the kernels (position x θ, reduced to ``[-π, π]``) and only then
cast, so positions far past training keep the float64 oracle's accuracy without a cos/sin
table as large as the cache.
Both kernels turn a key tile by angle sums (:func:`rotate_tile`: the tile's first angle in
float64, plus a per-program table of its offsets' angles).

- :func:`write_cache`: unrotated keys and values into their slots, skipping padded slots (-1),
  one program per (16 tokens, KV head).
- :func:`prefill`: one program per (query tile of a row, query head) walks the row's key
  tiles up to the causal edge. A tile wholly inside the window (``m - n < w`` for every pair)
  scores the query at ``m θ`` against keys rotated on load to ``n θ``; a tile wholly beyond
  it scores the query at its far angle ``(o + (m - w) ρ) θ`` against keys read raw (ReRoPE)
  or rotated to ``n ρ θ`` (grouped: ``(⌊m/g⌋ + w - ⌊w/g⌋) θ`` against ``⌊n/g⌋ θ``); a
  straddling tile computes both and picks per element. No log-sum-exp merge, one read of the keys.
- :func:`decode`: split-K over the paged cache, one program per (decode row, KV head, split)
  serving the KV head's ``queries_per_kv`` query heads together (one read of K and V for
  them), then a reduce over the splits by their log-sum-exps.

Both attention kernels run one key-tile loop (:func:`attend_key_tiles`), so the rule's
positions, :func:`rotate_pair`, :func:`tile_scores` and :func:`softmax_step` exist once. Both
multiply with ``tl.dot``: prefill's programs hold 16 queries or more, decode's pad a KV head's
few query heads to 16 rows (float32 broadcast sums remain as a decode launch choice). The
two neox halves of a vector travel as a pair ``(first, second)``, the row rule as one tuple
(:func:`load_row_rule`).

On CPU tensors these run under ``TRITON_INTERPRET=1`` (set before this module is imported):
the tests' way to check the GPU path without a GPU; ``tests/ops/compile_kernels.py`` compiles
them for a GPU target.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rope_plugins.attention.planner import DECODE_KEY_TILE, KernelPlan

# The launches that ran fastest on an H200 (bench/gpu_kernel_speed.py, with QUERY_TILE 128 and
# DECODE_KEY_TILE 64 in the planner): results/gpu_kernel_speed_tile_angles.json (prefill),
# results/gpu_kernel_speed_decode_dot.json (decode).
PREFILL_KEY_TILE = 64
PREFILL_WARPS = 8
DECODE_WARPS = 4
DECODE_DOT = True
DECODE_TILE_ANGLES = True
# not timed on a GPU: the cache write's tokens per program, for Triton's interpreter, which runs each program in Python
WRITE_TOKENS = 16

# ---------------------------------------------------------------------------------------------
# Loads, and the row rule: where a query or key stands, how much a query is scaled
# ---------------------------------------------------------------------------------------------


@triton.jit
def load_pair(at, mask, HALF: tl.constexpr):
    """The two neox halves of the vectors at ``at`` (their first halves): ``(at, at + d/2)``, masked to 0."""
    return tl.load(at, mask=mask, other=0.0), tl.load(at + HALF, mask=mask, other=0.0)


@triton.jit
def load_row_rule(row, theta_ptr, window_ptr, leak_ptr, far_origin_ptr, group_ptr, log_n_length_ptr,
                  query_factor_ptr, chunk_length_ptr, stride_theta, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Row ``row``'s rule as the kernels apply it: ``(θ [pairs] float64, window w, leak ρ, far
    origin o, Self-Extend's group g, log-n length L, query factor, chunk length s)``."""
    pairs = tl.arange(0, HALF_PAD)
    theta = tl.load(theta_ptr + row * stride_theta + pairs, mask=pairs < HALF, other=0.0)
    return (theta, tl.load(window_ptr + row), tl.load(leak_ptr + row), tl.load(far_origin_ptr + row),
            tl.load(group_ptr + row), tl.load(log_n_length_ptr + row), tl.load(query_factor_ptr + row),
            tl.load(chunk_length_ptr + row))


@triton.jit
def reduced_angle(angle):
    """A float64 angle reduced to ``[-π, π]``, as float32: what its float32 cosine can take exactly."""
    return (angle - 6.283185307179586 * tl.floor(angle * 0.15915494309189535 + 0.5)).to(tl.float32)


@triton.jit
def rotate_by(first, second, cos, sin):
    """The neox-style halves ``(first, second)`` rotated by the angles whose cosine and sine are given."""
    return first * cos - second * sin, second * cos + first * sin


@triton.jit
def rotate_pair(first, second, position, theta):
    """The halves ``[rows, half]`` rotated by ``position x θ``: the angle formed in float64."""
    angle = reduced_angle(position[:, None] * theta[None, :])
    return rotate_by(first, second, tl.cos(angle), tl.sin(angle))


@triton.jit
def tile_steps(theta, KEY_TILE: tl.constexpr):
    """cos and sin of ``j θ`` for the offsets ``j`` of a key tile, ``[KEY_TILE, half]``, once per program."""
    angle = reduced_angle(tl.arange(0, KEY_TILE).to(tl.float64)[:, None] * theta[None, :])
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rotate_tile(first, second, first_position, theta, steps):
    """A tile of keys at the consecutive positions ``p + j`` (``p``: ``first_position``, float64)
    rotated by ``(p + j) θ``: ``p θ`` formed in float64 once per tile, then added to the tile's
    :func:`tile_steps` (the angle-sum identities), so no key needs a float64 product or a cosine."""
    base = reduced_angle(first_position * theta)
    base_cos, base_sin = tl.cos(base)[None, :], tl.sin(base)[None, :]
    step_cos, step_sin = steps
    cos = base_cos * step_cos - base_sin * step_sin
    return rotate_by(first, second, cos, base_sin * step_cos + base_cos * step_sin)


@triton.jit
def query_window(position, window, far_origin, chunk_length):
    """Each query's window ``w(m)``: the row's ``w``; in chunks of ``s`` (local window ``o - s``)
    ``m mod s + 1``, plus ``s`` while ``m mod s <= o - s`` (the chunk before is near)."""
    chunks = tl.maximum(chunk_length, 1)
    offset = position % chunks
    chunked = offset + 1 + tl.where(offset <= far_origin - chunk_length, chunk_length, 0)
    return tl.where(chunk_length > 0, chunked, window)


@triton.jit
def far_query_position(position, window, leak, far_origin, group, chunk_length):
    """Where a query stands for its far keys: ``o + (m - w) ρ``; grouped ``⌊m/g⌋ + w - ⌊w/g⌋``;
    in chunks ``o``."""
    groups = tl.maximum(group, 1)
    grouped = (position // groups + window - window // groups).to(tl.float64)
    continuous = far_origin + (position - window).to(tl.float64) * leak
    continuous = tl.where(chunk_length > 0, far_origin.to(tl.float64), continuous)
    return tl.where(group > 0, grouped, continuous)


@triton.jit
def far_key_position(key_position, leak, group, chunk_length):
    """Where a key stands for far queries: ``n ρ``; grouped ``⌊n/g⌋``; in chunks of ``s`` ``n mod s``."""
    grouped = (key_position // tl.maximum(group, 1)).to(tl.float64)
    chunked = (key_position % tl.maximum(chunk_length, 1)).to(tl.float64)
    continuous = tl.where(chunk_length > 0, chunked, key_position.to(tl.float64) * leak)
    return tl.where(group > 0, grouped, continuous)


@triton.jit
def far_keys(keys, first_key, key_position, leak, group, chunk_length, theta, steps, STEPS: tl.constexpr):
    """Keys at their far angle (:func:`far_key_position` x θ); read raw under ReRoPE (``ρ = 0``).
    Ungrouped, a tile's far positions ``(p + j) ρ`` are consecutive steps of ``ρ θ`` (``STEPS``:
    :func:`rotate_tile`, else one angle per key); in chunks too, from ``p mod s`` (``ρ = 1``), when
    the tile's size divides ``s``: a tile starts at a multiple of its size, so it lies in one chunk."""
    far_first, far_second = keys
    if leak != 0.0:
        far_position = far_key_position(key_position, leak, group, chunk_length)
        if STEPS:  # a constexpr: decode has no steps to read
            if (group == 0) & (chunk_length % key_position.shape[0] == 0):
                first_far = far_key_position(tl.cast(first_key, tl.int64), leak, group, chunk_length)
                far_first, far_second = rotate_tile(far_first, far_second, first_far, theta, steps[1])
            else:
                far_first, far_second = rotate_pair(far_first, far_second, far_position, theta)
        else:
            far_first, far_second = rotate_pair(far_first, far_second, far_position, theta)
    return far_first, far_second


@triton.jit
def query_scale(position, log_n_length, query_factor):
    """log-n (``max(1, log(m + 1) / log(L))``, 1 when ``L`` is 0) x the row's query factor."""
    length = log_n_length.to(tl.float32)
    log_n = tl.maximum(tl.log((position + 1).to(tl.float32)) / tl.log(tl.maximum(length, 2.0)), 1.0)
    return tl.where(length > 0, log_n, 1.0) * query_factor.to(tl.float32)


@triton.jit
def rotated_queries(query_at, mask, position, softmax_scale, rule, HALF: tl.constexpr, OPERAND: tl.constexpr):
    """Queries ``[rows, pairs]`` scaled (:func:`query_scale` x the softmax scale), each at its
    near angle ``m θ`` and its far angle, as pairs of ``OPERAND`` (the scores' operand type)."""
    theta, window, leak, far_origin, group, log_n_length, query_factor, chunk_length = rule
    scale = query_scale(position, log_n_length, query_factor) * softmax_scale
    first, second = load_pair(query_at, mask, HALF)
    first = first.to(tl.float32) * scale[:, None]
    second = second.to(tl.float32) * scale[:, None]
    near_first, near_second = rotate_pair(first, second, position.to(tl.float64), theta)
    far_position = far_query_position(position, window, leak, far_origin, group, chunk_length)
    far_first, far_second = rotate_pair(first, second, far_position, theta)
    return (near_first.to(OPERAND), near_second.to(OPERAND)), (far_first.to(OPERAND), far_second.to(OPERAND))


# ---------------------------------------------------------------------------------------------
# The paged cache, and one key tile's scores and online-softmax step
# ---------------------------------------------------------------------------------------------


@triton.jit
def row_cache(cache_ptr, block_table_ptr, row, kv_head, stride_cb, stride_ch, stride_cs, stride_bt):
    """One KV head's view of one row's paged cache, as :func:`paged_keys` reads it."""
    return cache_ptr + kv_head * stride_ch, block_table_ptr + row * stride_bt, stride_cb, stride_cs


@triton.jit
def paged_keys(cache, key_position, valid, pairs, BLOCK_SIZE: tl.constexpr):
    """Where keys ``key_position`` lie in a :func:`row_cache`: ``[keys, pairs]`` addresses of
    their first half; the second half is ``+ d/2``, the value ``+ d``."""
    head_cache_ptr, block_table_row_ptr, stride_cb, stride_cs = cache
    block = tl.load(block_table_row_ptr + key_position // BLOCK_SIZE, mask=valid, other=0)
    return (head_cache_ptr + block.to(tl.int64)[:, None] * stride_cb
            + (key_position % BLOCK_SIZE)[:, None] * stride_cs + pairs[None, :])


@triton.jit
def pair_scores(query, key, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """``query · key`` ``[rows, keys]`` over both halves: by ``tl.dot`` in the queries' type, or
    (``DOT`` off: fewer than 16 rows) by float32 broadcast sums."""
    query_first, query_second = query
    key_first, key_second = key
    if DOT:
        scores = tl.dot(query_first, tl.trans(key_first.to(query_first.dtype)), input_precision=PRECISION)
        scores += tl.dot(query_second, tl.trans(key_second.to(query_first.dtype)), input_precision=PRECISION)
    else:
        scores = tl.sum(query_first[:, None, :] * key_first[None, :, :], axis=2)
        scores += tl.sum(query_second[:, None, :] * key_second[None, :, :], axis=2)
    return scores


@triton.jit
def tile_scores(near_query, far_query, keys, first_key, key_position, distance, windows, near_edges, rule,
                steps, DOT: tl.constexpr, PRECISION: tl.constexpr, STEPS: tl.constexpr):
    """One key tile's scores ``[rows, keys]``: near pairs (``m - n < w(m)``, ``windows`` ``[rows]``)
    score the near query against the keys rotated to ``n θ``, the others the far query against
    the far keys; each half computed only when some pair of the tile needs it (keys after
    ``m - w(m)`` are near: ``near_edges``, its least and greatest over the rows).
    ``STEPS``: keys rotated by ``steps``, the near and far :func:`tile_steps` (:func:`rotate_tile`)."""
    theta, window, leak, _, group, _, _, chunk_length = rule
    near = distance < windows[:, None]
    scores = tl.zeros(distance.shape, tl.float32)
    last_key = first_key + key_position.shape[0] - 1
    if (window > 0) & (last_key > near_edges[0]):  # some pair is near
        if STEPS:
            rotated = rotate_tile(keys[0], keys[1], tl.cast(first_key, tl.float64), theta, steps[0])
        else:
            rotated = rotate_pair(keys[0], keys[1], key_position.to(tl.float64), theta)
        scores = tl.where(near, pair_scores(near_query, rotated, DOT, PRECISION), scores)
    if first_key <= near_edges[1]:  # some pair is far
        far = far_keys(keys, first_key, key_position, leak, group, chunk_length, theta, steps, STEPS)
        scores = tl.where(near, scores, pair_scores(far_query, far, DOT, PRECISION))
    return scores


@triton.jit
def softmax_step(scores, running_max, running_sum):
    """One key tile of the online softmax: the new running max and sum, the tile's weights
    ``exp(s - max)``, and the factor that rescales what was accumulated before."""
    tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
    correction = tl.exp(running_max - tile_max)
    weights = tl.exp(scores - tile_max[:, None])
    return tile_max, running_sum * correction + tl.sum(weights, axis=1), weights, correction


@triton.jit
def weigh_values(out, weights, correction, value_at, mask, HALF: tl.constexpr, DOT: tl.constexpr,
                 PRECISION: tl.constexpr, OPERAND: tl.constexpr):
    """The output halves ``out`` rescaled by ``correction`` plus ``weights`` x the tile's values:
    by ``tl.dot`` in the queries' type ``OPERAND`` (an fp8 cache's values widened to it), or
    (``DOT`` off) by float32 broadcast sums."""
    out_first, out_second = out
    value_first, value_second = load_pair(value_at, mask, HALF)
    if DOT:
        value_first, value_second = value_first.to(OPERAND), value_second.to(OPERAND)
        weights = weights.to(OPERAND)
        out_first = out_first * correction[:, None] + tl.dot(weights, value_first, input_precision=PRECISION)
        out_second = out_second * correction[:, None] + tl.dot(weights, value_second, input_precision=PRECISION)
    else:
        value_first, value_second = value_first.to(tl.float32), value_second.to(tl.float32)
        out_first = out_first * correction[:, None] + tl.sum(weights[:, :, None] * value_first[None, :, :], axis=1)
        out_second = out_second * correction[:, None] + tl.sum(weights[:, :, None] * value_second[None, :, :], axis=1)
    return out_first, out_second


@triton.jit
def attend_key_tiles(near_query, far_query, position, rule, key_start, key_end, cache, HALF: tl.constexpr,
                     KEY_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PREFILL: tl.constexpr, DOT: tl.constexpr,
                     STEPS: tl.constexpr, PRECISION: tl.constexpr):
    """Queries at ``position`` (``[rows]``; near and far, from :func:`rotated_queries`) over
    keys ``key_start .. key_end`` of a :func:`row_cache`, up to the causal edge: the running
    max and sum of the online softmax, and the output halves not yet divided by the sum.
    ``PREFILL``: a tile of consecutive queries, whose causal edge can cut a key tile; otherwise
    one decode position (a KV head's query heads), which every key precedes. ``DOT``: scores and
    values by ``tl.dot`` (16 rows or more); ``STEPS``: key tiles rotated by angle sums."""
    last_query = tl.max(position, axis=0)
    pairs = tl.arange(0, near_query[0].shape[1])
    running_max = tl.full(position.shape, float("-inf"), tl.float32)
    running_sum = tl.zeros(position.shape, tl.float32)
    out = tl.zeros(near_query[0].shape, tl.float32), tl.zeros(near_query[0].shape, tl.float32)
    # Key tiles by angle sums: prefill 1.4x faster on an H200 at the same launch
    # (bench/results/gpu_kernel_speed_{key,tile}_angles.json), decode by tl.dot 1.3x for rows that
    # turn every key, ReRoPE's (far keys raw) 0.75x (gpu_kernel_speed_decode_dot.json; with
    # broadcast sums, whose products fill the registers, slower for all).
    theta, window, leak, far_origin, _, _, _, chunk_length = rule
    windows = query_window(position, window, far_origin, chunk_length)
    near_edges = tl.min(position - windows, axis=0), tl.max(position - windows, axis=0)
    if STEPS:
        steps = tile_steps(theta, KEY_TILE), tile_steps(theta * leak, KEY_TILE)
    else:
        steps = None
    for first_key in range(key_start, tl.minimum(key_end, last_query + 1), KEY_TILE):  # none after the last query
        key_position = first_key + tl.arange(0, KEY_TILE)
        valid = key_position < key_end
        key_at = paged_keys(cache, key_position, valid, pairs, BLOCK_SIZE)
        key_mask = valid[:, None] & (pairs < HALF)[None, :]
        keys = load_pair(key_at, key_mask, HALF)
        keys = keys[0].to(tl.float32), keys[1].to(tl.float32)
        distance = position[:, None] - key_position[None, :]
        scores = tile_scores(near_query, far_query, keys, first_key, key_position, distance, windows, near_edges,
                             rule, steps, DOT, PRECISION, STEPS)
        if PREFILL:
            scores = tl.where((distance >= 0) & valid[None, :], scores, float("-inf"))
        else:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        running_max, running_sum, weights, correction = softmax_step(scores, running_max, running_sum)
        out = weigh_values(out, weights, correction, key_at + 2 * HALF, key_mask, HALF, DOT, PRECISION,
                           near_query[0].dtype)
    return running_max, running_sum, out


# ---------------------------------------------------------------------------------------------
# The kernels. Parameters in groups, in this order: outputs; inputs; the paged cache; the step's
# rows; the row rule (KernelPlan's numbers); strides; constexpr sizes.
# ---------------------------------------------------------------------------------------------


@triton.jit
def fp8_rounded(x, largest, MANTISSA: tl.constexpr, LEAST_EXPONENT: tl.constexpr):
    """float32 ``x`` saturated at ``±largest`` and rounded to the nearest (ties to even) value of
    an fp8 format of ``MANTISSA`` bits whose least normal exponent is ``LEAST_EXPONENT``: a float32
    the format holds exactly, which any conversion then stores exactly. (Triton's interpreter
    converts to fp8 without carrying a rounding into the exponent: 7.96 becomes 4 in e4m3.)"""
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0, and what rounds to zero, keep theirs
    magnitude = tl.minimum(tl.abs(x), largest)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # the format's spacing at x, a power of two (subnormals: that of the least normal binade), and
    # its inverse: multiplying by either is exact (a GPU's float32 division is approximate)
    spacing_exponent = tl.maximum(exponent, LEAST_EXPONENT) - MANTISSA
    spacing = ((spacing_exponent + 127) << 23).to(tl.float32, bitcast=True)
    steps = magnitude * ((127 - spacing_exponent) << 23).to(tl.float32, bitcast=True)  # below 2^(MANTISSA + 1)
    rounded = ((steps + 8388608.0) - 8388608.0) * spacing  # 2^23: float32 addition rounds to an integer
    return tl.where(negative, -rounded, rounded)


@triton.jit
def write_cache_kernel(
    # outputs
    cache_ptr,  # [blocks, kv heads, block, 2d]: keys then values, unrotated
    # inputs
    key_ptr, value_ptr,  # [T, kv heads, d]
    key_scale, value_scale, largest,  # an fp8 cache's: each key and value is stored divided by its scale
    # the step's rows
    slot_ptr,  # [T] each token's slot; -1: padding
    token_count,  # T
    # strides
    stride_cb, stride_ch, stride_cs, stride_kt, stride_kh, stride_vt, stride_vh,
    # constexpr sizes
    TOKENS: tl.constexpr,  # tokens per program
    BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, QUANTIZE: tl.constexpr,
    MANTISSA: tl.constexpr, LEAST_EXPONENT: tl.constexpr,  # an fp8 cache's format
):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_ptr + tokens, mask=tokens < token_count, other=-1).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    written = (slot >= 0)[:, None] & (dims < HEAD)[None, :]  # slot -1: a padded token, nothing to write
    key = tl.load(key_ptr + tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=written)
    value = tl.load(value_ptr + tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=written)
    if QUANTIZE:
        # divided as IEEE divides (round to nearest), as vLLM's CUDA cache write does
        key = fp8_rounded(tl.math.div_rn(key.to(tl.float32), key_scale), largest, MANTISSA, LEAST_EXPONENT)
        value = fp8_rounded(tl.math.div_rn(value.to(tl.float32), value_scale), largest, MANTISSA, LEAST_EXPONENT)
    cached = cache_ptr.dtype.element_ty
    target = (cache_ptr + (slot // BLOCK_SIZE)[:, None] * stride_cb + kv_head * stride_ch
              + (slot % BLOCK_SIZE)[:, None] * stride_cs + dims[None, :])
    tl.store(target, key.to(cached), mask=written)
    tl.store(target + HEAD, value.to(cached), mask=written)


@triton.jit
def prefill_kernel(
    # outputs
    out_ptr,  # [T, heads, d]
    # inputs
    query_ptr, softmax_scale,  # [T, heads, d] unrotated; an fp8 cache's key scale included
    # the paged cache
    cache_ptr, block_table_ptr,  # [blocks, kv heads, block, 2d] unrotated keys, then values; [R, max blocks]
    value_scale,  # an fp8 cache's (1 otherwise): the output's factor
    # the step's rows
    query_start_ptr, seq_lens_ptr,  # [R + 1], [R]
    tile_row_ptr, tile_start_ptr,  # [programs] each program's batch row, and its first query in the row's chunk
    # the row rule
    theta_ptr, window_ptr, leak_ptr, far_origin_ptr, group_ptr, log_n_length_ptr, query_factor_ptr,  # [R, d/2], [R]
    chunk_length_ptr,  # [R]
    # strides
    stride_ot, stride_oh, stride_qt, stride_qh, stride_cb, stride_ch, stride_cs, stride_bt, stride_theta,
    # constexpr sizes
    BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    QUERY_TILE: tl.constexpr, KEY_TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (query tile of a row's chunk, query head)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(tile_row_ptr + tile)
    first_query = tl.load(tile_start_ptr + tile)  # in the row's chunk
    query_start = tl.load(query_start_ptr + row)
    chunk = tl.load(query_start_ptr + row + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + row)
    rule = load_row_rule(row, theta_ptr, window_ptr, leak_ptr, far_origin_ptr, group_ptr, log_n_length_ptr,
                         query_factor_ptr, chunk_length_ptr, stride_theta, HALF, HALF_PAD)

    pairs = tl.arange(0, HALF_PAD)
    chunk_index = first_query + tl.arange(0, QUERY_TILE)
    position = seq_len - chunk + chunk_index
    token = (query_start + chunk_index).to(tl.int64)
    query_mask = (chunk_index < chunk)[:, None] & (pairs < HALF)[None, :]
    near_query, far_query = rotated_queries(query_ptr + token[:, None] * stride_qt + head * stride_qh + pairs[None, :],
                                            query_mask, position, softmax_scale, rule, HALF=HALF,
                                            OPERAND=query_ptr.dtype.element_ty)
    cache = row_cache(cache_ptr, block_table_ptr, row, head // QUERIES_PER_KV, stride_cb, stride_ch, stride_cs,
                      stride_bt)
    _, running_sum, out = attend_key_tiles(near_query, far_query, position, rule, 0, seq_len, cache, HALF=HALF,
                                           KEY_TILE=KEY_TILE, BLOCK_SIZE=BLOCK_SIZE, PREFILL=True, DOT=True, STEPS=True,
                                           PRECISION=PRECISION)

    out_at = out_ptr + token[:, None] * stride_ot + head * stride_oh + pairs[None, :]
    out_type = out_ptr.dtype.element_ty
    normaliser = running_sum[:, None] / value_scale
    tl.store(out_at, (out[0] / normaliser).to(out_type), mask=query_mask)
    tl.store(out_at + HALF, (out[1] / normaliser).to(out_type), mask=query_mask)


@triton.jit
def decode_split_kernel(
    # outputs
    partial_ptr, lse_ptr,  # [Rd, heads, splits, d] each split's normalised output; [Rd, heads, splits] its log-sum-exp
    # inputs
    query_ptr, softmax_scale,  # [T, heads, d] unrotated; an fp8 cache's key scale included
    # the paged cache
    cache_ptr, block_table_ptr,  # [blocks, kv heads, block, 2d] unrotated keys, then values; [R, max blocks]
    # the step's rows
    query_start_ptr, seq_lens_ptr,  # [R + 1], [R]
    decode_rows_ptr, split_keys,  # [Rd] the decode rows' batch rows; keys per split
    # the row rule
    theta_ptr, window_ptr, leak_ptr, far_origin_ptr, group_ptr, log_n_length_ptr, query_factor_ptr,  # [R, d/2], [R]
    chunk_length_ptr,  # [R]
    # strides
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_qt, stride_qh, stride_cb, stride_ch, stride_cs,
    stride_bt, stride_theta,
    # constexpr sizes
    BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, QUERIES_PER_KV_PAD: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, KEY_TILE: tl.constexpr, DOT: tl.constexpr, STEPS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (decode row, KV head, split of the row's keys): the KV head's query heads
    together (``DOT``: padded to 16 rows, ``tl.dot``'s least, in the queries' type)."""
    decode_row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(decode_rows_ptr + decode_row)
    token = tl.load(query_start_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    rule = load_row_rule(row, theta_ptr, window_ptr, leak_ptr, far_origin_ptr, group_ptr, log_n_length_ptr,
                         query_factor_ptr, chunk_length_ptr, stride_theta, HALF, HALF_PAD)

    pairs = tl.arange(0, HALF_PAD)
    heads = kv_head * QUERIES_PER_KV + tl.arange(0, QUERIES_PER_KV_PAD)
    is_head = tl.arange(0, QUERIES_PER_KV_PAD) < QUERIES_PER_KV
    query_mask = is_head[:, None] & (pairs < HALF)[None, :]
    position = tl.full([QUERIES_PER_KV_PAD], seq_len - 1, tl.int32)  # every head's query is the row's last token
    near_query, far_query = rotated_queries(query_ptr + token * stride_qt + heads[:, None] * stride_qh + pairs[None, :],
                                            query_mask, position, softmax_scale, rule, HALF=HALF,
                                            OPERAND=query_ptr.dtype.element_ty if DOT else tl.float32)
    cache = row_cache(cache_ptr, block_table_ptr, row, kv_head, stride_cb, stride_ch, stride_cs, stride_bt)
    split_start = split * split_keys
    running_max, running_sum, out = attend_key_tiles(near_query, far_query, position, rule, split_start,
                                                     tl.minimum(seq_len, split_start + split_keys), cache, HALF=HALF,
                                                     KEY_TILE=KEY_TILE, BLOCK_SIZE=BLOCK_SIZE, PREFILL=False,
                                                     DOT=DOT, STEPS=STEPS, PRECISION=PRECISION)

    # an empty split (past the row's end) leaves a zero output and a log-sum-exp of -inf
    has_keys = running_sum > 0
    normaliser = tl.where(has_keys, running_sum, 1.0)
    partial_at = (partial_ptr + decode_row * stride_pr + heads[:, None] * stride_ph + split * stride_ps
                  + pairs[None, :])
    tl.store(partial_at, out[0] / normaliser[:, None], mask=query_mask)
    tl.store(partial_at + HALF, out[1] / normaliser[:, None], mask=query_mask)
    lse = tl.where(has_keys, running_max + tl.log(normaliser), float("-inf"))
    tl.store(lse_ptr + decode_row * stride_lr + heads * stride_lh + split, lse, mask=is_head)


@triton.jit
def decode_reduce_kernel(
    # outputs
    out_ptr,  # [T, heads, d]
    # inputs
    partial_ptr, lse_ptr,  # decode_split_kernel's outputs
    value_scale,  # an fp8 cache's (1 otherwise): the output's factor
    # the step's rows
    query_start_ptr, decode_rows_ptr, splits,
    # strides
    stride_ot, stride_oh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    # constexpr sizes
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    decode_row = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + tl.load(decode_rows_ptr + decode_row)).to(tl.int64)
    split = tl.arange(0, SPLITS_PAD)
    in_splits = split < splits
    lse = tl.load(lse_ptr + decode_row * stride_lr + head * stride_lh + split, mask=in_splits, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))  # the first split always has keys: the max is finite
    dims = tl.arange(0, HEAD_PAD)
    partial = tl.load(partial_ptr + decode_row * stride_pr + head * stride_ph + split[:, None] * stride_ps
                      + dims[None, :], mask=in_splits[:, None] & (dims < HEAD)[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial, axis=0) * (value_scale / tl.sum(weights, axis=0))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD)


# ---------------------------------------------------------------------------------------------
# Launches
# ---------------------------------------------------------------------------------------------


# each fp8 cache format's grid for fp8_rounded: its mantissa bits and least normal exponent
FP8_GRIDS = {torch.float8_e4m3fn: dict(MANTISSA=3, LEAST_EXPONENT=-6),
             torch.float8_e5m2: dict(MANTISSA=2, LEAST_EXPONENT=-14)}


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """Unrotated keys and values ``[T, kv, d]`` into their slots of ``kv_cache``
    ``[blocks, kv, block, 2d]``; slots of -1 (padding) are skipped. An fp8 cache holds each
    divided by its scale, saturated and rounded to nearest, as vLLM's CUDA cache writes fp8 (the
    CPU ops round toward zero, as vLLM's CPU cache does)."""
    tokens, kv_heads, head = key.shape
    if tokens == 0:
        return
    grid = FP8_GRIDS.get(kv_cache.dtype)  # None: the cache holds the model's dtype, stored as it is
    write_cache_kernel[(triton.cdiv(tokens, WRITE_TOKENS), kv_heads)](
        cache_ptr=kv_cache, key_ptr=key, value_ptr=value, slot_ptr=slot_mapping, token_count=tokens,
        key_scale=key_scale, value_scale=value_scale, largest=torch.finfo(kv_cache.dtype).max if grid else 0.0,
        QUANTIZE=grid is not None, **(grid or dict(MANTISSA=0, LEAST_EXPONENT=0)),
        stride_cb=kv_cache.stride(0), stride_ch=kv_cache.stride(1), stride_cs=kv_cache.stride(2),
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
        TOKENS=WRITE_TOKENS, BLOCK_SIZE=kv_cache.shape[2], HEAD=head, HEAD_PAD=triton.next_power_of_2(head))


def pairs_padded(head: int) -> int:
    """The rotation pairs ``d/2`` padded to a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head // 2))


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 models score in true float32 (GPUs default to TF32, 10-bit mantissas); half
    precision takes the target's default."""
    return "ieee" if dtype == torch.float32 else None


def attention_arguments(query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, key_tile: int) -> dict:
    """What both attention kernels take alike: the queries, the paged cache, the step's rows,
    the row rule (KernelPlan's numbers) and the sizes."""
    heads, head = query.shape[1], query.shape[2]
    assert kv_cache.stride(-1) == 1 and query.stride(-1) == 1, "the kernels read rows of d contiguous values"
    return dict(
        query_ptr=query, cache_ptr=kv_cache, block_table_ptr=plan.block_table,
        query_start_ptr=plan.query_start, seq_lens_ptr=plan.seq_lens,
        theta_ptr=plan.theta, window_ptr=plan.window, leak_ptr=plan.leak, far_origin_ptr=plan.far_origin,
        group_ptr=plan.group, log_n_length_ptr=plan.log_n_length, query_factor_ptr=plan.query_factor,
        chunk_length_ptr=plan.chunk_length,
        stride_qt=query.stride(0), stride_qh=query.stride(1), stride_cb=kv_cache.stride(0),
        stride_ch=kv_cache.stride(1), stride_cs=kv_cache.stride(2), stride_bt=plan.block_table.stride(0),
        stride_theta=plan.theta.stride(0),
        BLOCK_SIZE=kv_cache.shape[2], QUERIES_PER_KV=heads // kv_cache.shape[1], HALF=head // 2,
        HALF_PAD=pairs_padded(head), KEY_TILE=key_tile)


def prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, output: torch.Tensor, *,
            scale: float, key_tile: int = PREFILL_KEY_TILE, num_warps: int = PREFILL_WARPS, key_scale: float = 1.0,
            value_scale: float = 1.0) -> None:
    """Every prefill row's queries ``[T, heads, d]`` (unrotated) into ``output``; ``key_tile`` and
    ``num_warps``: launch choices (bench/gpu_kernel_speed.py sweeps them), any of which is exact.
    An fp8 cache's scales fold into the softmax scale (``q . (s k) = s (q . k)``) and the output."""
    tiles = plan.prefill_tiles
    if tiles is None:
        return
    prefill_kernel[(tiles.row.numel(), query.shape[1])](
        out_ptr=output, softmax_scale=scale * key_scale, value_scale=value_scale, tile_row_ptr=tiles.row,
        tile_start_ptr=tiles.start,
        stride_ot=output.stride(0), stride_oh=output.stride(1), QUERY_TILE=tiles.size,
        PRECISION=dot_precision(query.dtype), num_warps=num_warps,
        **attention_arguments(query, kv_cache, plan, key_tile))


def decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, output: torch.Tensor, *,
           scale: float, key_tile: int = DECODE_KEY_TILE, num_warps: int = DECODE_WARPS, dot: bool = DECODE_DOT,
           tile_angles: bool = DECODE_TILE_ANGLES, key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """Every decode row's query ``[heads, d]`` (unrotated) into ``output``: split-K, then a reduce.
    ``key_tile``, ``num_warps``, ``dot`` (a KV head's queries padded to 16 rows for ``tl.dot``,
    else broadcast sums in float32) and ``tile_angles`` (key tiles rotated by angle sums, where
    the splits hold whole tiles: a dual-chunk tile must lie in one chunk): launch choices
    (bench/gpu_kernel_speed.py sweeps them), any of which is exact. An fp8 cache's scales as
    :func:`prefill`'s."""
    rows = plan.decode_rows
    if rows is None:
        return
    tile_angles = tile_angles and rows.split_keys % key_tile == 0
    count, (heads, head), kv_heads = rows.row.numel(), query.shape[1:], kv_cache.shape[1]
    group_rows = triton.next_power_of_2(heads // kv_heads)
    partial = torch.empty(count, heads, rows.splits, head, dtype=torch.float32, device=query.device)
    lse = torch.empty(count, heads, rows.splits, dtype=torch.float32, device=query.device)
    decode_split_kernel[(count, kv_heads, rows.splits)](
        partial_ptr=partial, lse_ptr=lse, softmax_scale=scale * key_scale, decode_rows_ptr=rows.row,
        split_keys=rows.split_keys,
        stride_pr=partial.stride(0), stride_ph=partial.stride(1), stride_ps=partial.stride(2),
        stride_lr=lse.stride(0), stride_lh=lse.stride(1),
        QUERIES_PER_KV_PAD=max(16, group_rows) if dot else group_rows, DOT=dot, STEPS=tile_angles,
        PRECISION=dot_precision(query.dtype), num_warps=num_warps,
        **attention_arguments(query, kv_cache, plan, key_tile))
    decode_reduce_kernel[(count, heads)](
        out_ptr=output, partial_ptr=partial, lse_ptr=lse, value_scale=value_scale, query_start_ptr=plan.query_start,
        decode_rows_ptr=rows.row,
        splits=rows.splits, stride_ot=output.stride(0), stride_oh=output.stride(1), stride_pr=partial.stride(0),
        stride_ph=partial.stride(1), stride_ps=partial.stride(2), stride_lr=lse.stride(0), stride_lh=lse.stride(1),
        HEAD=head, HEAD_PAD=triton.next_power_of_2(head), SPLITS_PAD=triton.next_power_of_2(rows.splits))
