"""The attention's Triton kernels on the pre-rotation paged cache (vLLM's CUDA build).

Each row's rule comes as numbers, not tables: its frequencies ``θ`` (float64), window ``w``,
leak ``ρ`` and group ``g`` (Self-Extend's far positions floored to groups; 0: none), and every
query token's scale (log-n x the method's factor). Angles are
formed in float64 inside the kernels (position x θ, reduced to ``[-π, π]``) and only then
cast, so positions far past training keep the float64 oracle's accuracy without a cos/sin
table as large as the cache.

- :func:`write_cache`: unrotated keys and values into their slots, skipping padded slots (-1).
- :func:`prefill`: one program per (query tile of a row, query head) walks the row's key
  tiles up to the causal edge. A tile wholly inside the window (``m - n < w`` for every pair)
  scores the query at ``m θ`` against keys rotated on load to ``n θ``; a tile wholly beyond
  it scores the query at its far angle ``(w + (m - w) ρ) θ`` against keys read raw (ReRoPE)
  or rotated to ``n ρ θ`` (grouped: ``(⌊m/g⌋ + w - ⌊w/g⌋) θ`` against ``⌊n/g⌋ θ``); a
  straddling tile computes both and picks per element. No log-sum-exp merge, one read of the keys.
- :func:`decode`: split-K over the paged cache, one program per (decode row, KV head, split)
  serving the KV head's query heads together (one read of K and V for the group), then a
  reduce over the splits by their log-sum-exps.

On CPU tensors these run under ``TRITON_INTERPRET=1`` (set before this module is imported):
the tests' way to check the GPU path without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rope_plugins.attention.planner import KEY_TILE, KernelPlan


@triton.jit
def rotate_pair(first, second, position, theta):
    """The neox-style halves ``(first, second)`` ``[rows, half]`` rotated by ``position x θ``:
    the angle in float64, reduced to ``[-π, π]`` before its float32 cosine."""
    angle = position[:, None] * theta[None, :]
    angle = angle - 6.283185307179586 * tl.floor(angle * 0.15915494309189535 + 0.5)
    cos = tl.cos(angle.to(tl.float32))
    sin = tl.sin(angle.to(tl.float32))
    return first * cos - second * sin, second * cos + first * sin


@triton.jit
def far_query_position(position, window, leak, group):
    """Where a query stands for its far keys: ``w + (m - w) ρ``; grouped ``⌊m/g⌋ + w - ⌊w/g⌋``."""
    groups = tl.maximum(group, 1)
    grouped = (position // groups + window - window // groups).to(tl.float64)
    return tl.where(group > 0, grouped, window + (position - window).to(tl.float64) * leak)


@triton.jit
def far_key_position(key_position, leak, group):
    """Where a key stands for far queries: ``n ρ``; grouped ``⌊n/g⌋``."""
    grouped = (key_position // tl.maximum(group, 1)).to(tl.float64)
    return tl.where(group > 0, grouped, key_position.to(tl.float64) * leak)


@triton.jit
def far_keys(first, second, key_position, leak, group, theta):
    """Keys at their far angle (:func:`far_key_position` x θ); read raw under ReRoPE (``ρ = 0``)."""
    far_first, far_second = first, second
    if leak != 0.0:
        far_first, far_second = rotate_pair(first, second, far_key_position(key_position, leak, group), theta)
    return far_first, far_second


@triton.jit
def paged_keys(cache_ptr, block_table_row_ptr, key_position, valid, kv_head, pairs, stride_cb, stride_ch, stride_cs,
               BLOCK_SIZE: tl.constexpr):
    """Where keys ``key_position`` of one sequence (its block-table row) lie in the paged cache:
    ``[keys, pairs]`` addresses of their first half; the second half is ``+ d/2``, the value ``+ d``."""
    block = tl.load(block_table_row_ptr + key_position // BLOCK_SIZE, mask=valid, other=0)
    return (cache_ptr + block.to(tl.int64)[:, None] * stride_cb + kv_head * stride_ch
            + (key_position % BLOCK_SIZE)[:, None] * stride_cs + pairs[None, :])


@triton.jit
def query_scale(position, log_n_length, query_factor):
    """log-n (``max(1, log(m + 1) / log(L))``, 1 when ``L`` is 0) x the row's query factor."""
    length = log_n_length.to(tl.float32)
    log_n = tl.maximum(tl.log((position + 1).to(tl.float32)) / tl.log(tl.maximum(length, 2.0)), 1.0)
    return tl.where(length > 0, log_n, 1.0) * query_factor.to(tl.float32)


@triton.jit
def write_cache_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cb, stride_ch, stride_cs, BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr,
                       HEAD_PAD: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padded token, nothing to write
        dims = tl.arange(0, HEAD_PAD)
        inside = dims < HEAD
        key = tl.load(key_ptr + token * stride_kt + kv_head * stride_kh + dims, mask=inside)
        value = tl.load(value_ptr + token * stride_vt + kv_head * stride_vh + dims, mask=inside)
        target = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + kv_head * stride_ch + (slot % BLOCK_SIZE) * stride_cs
        tl.store(target + dims, key, mask=inside)
        tl.store(target + HEAD + dims, value, mask=inside)


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Unrotated keys and values ``[T, kv, d]`` into their slots of ``kv_cache``
    ``[blocks, kv, block, 2d]``; slots of -1 (padding) are skipped."""
    tokens, kv_heads, head = key.shape
    if tokens == 0:
        return
    write_cache_kernel[(tokens, kv_heads)](
        key, value, kv_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), BLOCK_SIZE=kv_cache.shape[2], HEAD=head,
        HEAD_PAD=triton.next_power_of_2(head))


@triton.jit
def prefill_kernel(out_ptr, query_ptr, cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr, theta_ptr,
                   window_ptr, leak_ptr, log_n_length_ptr, query_factor_ptr, group_ptr, tile_row_ptr, tile_start_ptr,
                   softmax_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cs, stride_bt,
                   stride_theta, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, QUERY_TILE: tl.constexpr, KEY_TILE: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(tile_row_ptr + tile)
    first_query = tl.load(tile_start_ptr + tile)  # in the row's chunk
    query_start = tl.load(query_start_ptr + row)
    chunk = tl.load(query_start_ptr + row + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - chunk
    window = tl.load(window_ptr + row)
    leak = tl.load(leak_ptr + row)
    group = tl.load(group_ptr + row)

    pairs = tl.arange(0, HALF_PAD)
    in_half = pairs < HALF
    theta = tl.load(theta_ptr + row * stride_theta + pairs, mask=in_half, other=0.0)
    chunk_index = first_query + tl.arange(0, QUERY_TILE)
    in_chunk = chunk_index < chunk
    query_position = context + chunk_index
    token = (query_start + chunk_index).to(tl.int64)
    query_at = query_ptr + token[:, None] * stride_qt + head * stride_qh + pairs[None, :]
    query_mask = in_chunk[:, None] & in_half[None, :]
    scale = query_scale(query_position, tl.load(log_n_length_ptr + row), tl.load(query_factor_ptr + row)) * softmax_scale
    first = tl.load(query_at, mask=query_mask, other=0.0).to(tl.float32) * scale[:, None]
    second = tl.load(query_at + HALF, mask=query_mask, other=0.0).to(tl.float32) * scale[:, None]
    near_first, near_second = rotate_pair(first, second, query_position.to(tl.float64), theta)
    far_first, far_second = rotate_pair(first, second, far_query_position(query_position, window, leak, group), theta)
    dot_type = query_ptr.dtype.element_ty
    near_first, near_second = near_first.to(dot_type), near_second.to(dot_type)
    far_first, far_second = far_first.to(dot_type), far_second.to(dot_type)

    running_max = tl.full([QUERY_TILE], float("-inf"), tl.float32)
    running_sum = tl.zeros([QUERY_TILE], tl.float32)
    out_first = tl.zeros([QUERY_TILE, HALF_PAD], tl.float32)
    out_second = tl.zeros([QUERY_TILE, HALF_PAD], tl.float32)
    last_query = context + first_query + QUERY_TILE - 1
    key_end = tl.minimum(seq_len, last_query + 1)  # causal: no key after the tile's last query
    for first_key in range(0, key_end, KEY_TILE):
        key_position = first_key + tl.arange(0, KEY_TILE)
        in_sequence = key_position < seq_len
        key_at = paged_keys(cache_ptr, block_table_ptr + row * stride_bt, key_position, in_sequence, kv_head,
                            pairs, stride_cb, stride_ch, stride_cs, BLOCK_SIZE)
        key_mask = in_sequence[:, None] & in_half[None, :]
        key_first = tl.load(key_at, mask=key_mask, other=0.0).to(tl.float32)
        key_second = tl.load(key_at + HALF, mask=key_mask, other=0.0).to(tl.float32)
        distance = query_position[:, None] - key_position[None, :]
        near = distance < window
        scores = tl.zeros([QUERY_TILE, KEY_TILE], tl.float32)
        if (window > 0) & (context + first_query - (first_key + KEY_TILE - 1) < window):  # some pair is near
            rotated_first, rotated_second = rotate_pair(key_first, key_second, key_position.to(tl.float64), theta)
            near_scores = tl.dot(near_first, tl.trans(rotated_first.to(dot_type)), input_precision=PRECISION)
            near_scores += tl.dot(near_second, tl.trans(rotated_second.to(dot_type)), input_precision=PRECISION)
            scores = tl.where(near, near_scores, scores)
        if last_query - first_key >= window:  # some pair is far
            far_key_first, far_key_second = far_keys(key_first, key_second, key_position, leak, group, theta)
            far_scores = tl.dot(far_first, tl.trans(far_key_first.to(dot_type)), input_precision=PRECISION)
            far_scores += tl.dot(far_second, tl.trans(far_key_second.to(dot_type)), input_precision=PRECISION)
            scores = tl.where(near, scores, far_scores)
        scores = tl.where((distance >= 0) & in_sequence[None, :], scores, float("-inf"))

        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - tile_max)
        weights = tl.exp(scores - tile_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        value_first = tl.load(key_at + 2 * HALF, mask=key_mask, other=0.0)
        value_second = tl.load(key_at + 3 * HALF, mask=key_mask, other=0.0)
        weights = weights.to(value_first.dtype)
        out_first = out_first * correction[:, None] + tl.dot(weights, value_first, input_precision=PRECISION)
        out_second = out_second * correction[:, None] + tl.dot(weights, value_second, input_precision=PRECISION)
        running_max = tile_max

    out_at = out_ptr + token[:, None] * stride_ot + head * stride_oh + pairs[None, :]
    out_type = out_ptr.dtype.element_ty
    tl.store(out_at, (out_first / running_sum[:, None]).to(out_type), mask=query_mask)
    tl.store(out_at + HALF, (out_second / running_sum[:, None]).to(out_type), mask=query_mask)


@triton.jit
def decode_split_kernel(partial_ptr, lse_ptr, query_ptr, cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr,
                        theta_ptr, window_ptr, leak_ptr, log_n_length_ptr, query_factor_ptr, group_ptr, decode_rows_ptr,
                        softmax_scale,
                        split_keys, stride_qt, stride_qh, stride_cb, stride_ch, stride_cs, stride_bt, stride_theta,
                        stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, BLOCK_SIZE: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                        KEY_TILE: tl.constexpr):
    decode_row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(decode_rows_ptr + decode_row)
    token = tl.load(query_start_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    window = tl.load(window_ptr + row)
    leak = tl.load(leak_ptr + row)
    group = tl.load(group_ptr + row)
    position = seq_len - 1

    pairs = tl.arange(0, HALF_PAD)
    in_half = pairs < HALF
    theta = tl.load(theta_ptr + row * stride_theta + pairs, mask=in_half, other=0.0)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    in_group = tl.arange(0, GROUP_PAD) < GROUP
    query_at = query_ptr + token * stride_qt + heads[:, None] * stride_qh + pairs[None, :]
    query_mask = in_group[:, None] & in_half[None, :]
    scale = query_scale(position, tl.load(log_n_length_ptr + row), tl.load(query_factor_ptr + row)) * softmax_scale
    first = tl.load(query_at, mask=query_mask, other=0.0).to(tl.float32) * scale
    second = tl.load(query_at + HALF, mask=query_mask, other=0.0).to(tl.float32) * scale
    near_angle = tl.full([GROUP_PAD], position, tl.float64)
    near_first, near_second = rotate_pair(first, second, near_angle, theta)
    far_angle = tl.full([GROUP_PAD], far_query_position(position, window, leak, group), tl.float64)
    far_first, far_second = rotate_pair(first, second, far_angle, theta)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    out_first = tl.zeros([GROUP_PAD, HALF_PAD], tl.float32)
    out_second = tl.zeros([GROUP_PAD, HALF_PAD], tl.float32)
    split_start = split * split_keys
    split_end = tl.minimum(seq_len, split_start + split_keys)
    for first_key in range(split_start, split_end, KEY_TILE):
        key_position = first_key + tl.arange(0, KEY_TILE)
        in_split = key_position < split_end
        key_at = paged_keys(cache_ptr, block_table_ptr + row * stride_bt, key_position, in_split, kv_head, pairs,
                            stride_cb, stride_ch, stride_cs, BLOCK_SIZE)
        key_mask = in_split[:, None] & in_half[None, :]
        key_first = tl.load(key_at, mask=key_mask, other=0.0).to(tl.float32)
        key_second = tl.load(key_at + HALF, mask=key_mask, other=0.0).to(tl.float32)
        near = position - key_position < window  # [KEY_TILE]
        scores = tl.zeros([GROUP_PAD, KEY_TILE], tl.float32)
        if (window > 0) & (position - (first_key + KEY_TILE - 1) < window):  # some key is near
            rotated_first, rotated_second = rotate_pair(key_first, key_second, key_position.to(tl.float64), theta)
            near_scores = tl.sum(near_first[:, None, :] * rotated_first[None, :, :], axis=2)
            near_scores += tl.sum(near_second[:, None, :] * rotated_second[None, :, :], axis=2)
            scores = tl.where(near[None, :], near_scores, scores)
        if position - first_key >= window:  # some key is far
            far_key_first, far_key_second = far_keys(key_first, key_second, key_position, leak, group, theta)
            far_scores = tl.sum(far_first[:, None, :] * far_key_first[None, :, :], axis=2)
            far_scores += tl.sum(far_second[:, None, :] * far_key_second[None, :, :], axis=2)
            scores = tl.where(near[None, :], scores, far_scores)
        scores = tl.where(in_split[None, :], scores, float("-inf"))

        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - tile_max)
        weights = tl.exp(scores - tile_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        value_first = tl.load(key_at + 2 * HALF, mask=key_mask, other=0.0).to(tl.float32)
        value_second = tl.load(key_at + 3 * HALF, mask=key_mask, other=0.0).to(tl.float32)
        out_first = out_first * correction[:, None] + tl.sum(weights[:, :, None] * value_first[None, :, :], axis=1)
        out_second = out_second * correction[:, None] + tl.sum(weights[:, :, None] * value_second[None, :, :], axis=1)
        running_max = tile_max

    # an empty split (past the row's end) leaves a zero output and a log-sum-exp of -inf
    has_keys = running_sum > 0
    normaliser = tl.where(has_keys, running_sum, 1.0)
    partial_at = (partial_ptr + decode_row * stride_pr + heads[:, None] * stride_ph + split * stride_ps
                  + pairs[None, :])
    tl.store(partial_at, out_first / normaliser[:, None], mask=query_mask)
    tl.store(partial_at + HALF, out_second / normaliser[:, None], mask=query_mask)
    lse = tl.where(has_keys, running_max + tl.log(normaliser), float("-inf"))
    tl.store(lse_ptr + decode_row * stride_lr + heads * stride_lh + split, lse, mask=in_group)


@triton.jit
def decode_reduce_kernel(out_ptr, partial_ptr, lse_ptr, query_start_ptr, decode_rows_ptr, splits, stride_ot,
                         stride_oh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, HEAD: tl.constexpr,
                         HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
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
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD)


def pairs_padded(head: int) -> int:
    """The rotation pairs ``d/2`` padded to a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head // 2))


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 models score in true float32 (GPUs default to TF32, 10-bit mantissas); half
    precision takes the target's default."""
    return "ieee" if dtype == torch.float32 else None


def prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, output: torch.Tensor, *,
            scale: float) -> None:
    """Every prefill row's queries ``[T, heads, d]`` (unrotated) into ``output``."""
    tiles = plan.prefill_tiles
    if tiles is None:
        return
    assert kv_cache.stride(-1) == 1 and query.stride(-1) == 1, "the kernels read rows of d contiguous values"
    heads, head = query.shape[1], query.shape[2]
    prefill_kernel[(tiles.row.numel(), heads)](
        output, query, kv_cache, plan.block_table, plan.query_start, plan.seq_lens, plan.theta, plan.window,
        plan.leak, plan.log_n_length, plan.query_factor, plan.group, tiles.row, tiles.start, scale, query.stride(0), query.stride(1),
        output.stride(0), output.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        plan.block_table.stride(0), plan.theta.stride(0), BLOCK_SIZE=kv_cache.shape[2],
        GROUP=heads // kv_cache.shape[1], HALF=head // 2, HALF_PAD=pairs_padded(head),
        QUERY_TILE=tiles.size, KEY_TILE=KEY_TILE, PRECISION=dot_precision(query.dtype))


def decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, output: torch.Tensor, *,
           scale: float) -> None:
    """Every decode row's query ``[heads, d]`` (unrotated) into ``output``: split-K, then a reduce."""
    rows = plan.decode_rows
    if rows is None:
        return
    count, (heads, head), kv_heads = rows.row.numel(), query.shape[1:], kv_cache.shape[1]
    group = heads // kv_heads
    partial = torch.empty(count, heads, rows.splits, head, dtype=torch.float32, device=query.device)
    lse = torch.empty(count, heads, rows.splits, dtype=torch.float32, device=query.device)
    decode_split_kernel[(count, kv_heads, rows.splits)](
        partial, lse, query, kv_cache, plan.block_table, plan.query_start, plan.seq_lens, plan.theta, plan.window,
        plan.leak, plan.log_n_length, plan.query_factor, plan.group, rows.row, scale, rows.split_keys, query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), plan.block_table.stride(0), plan.theta.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        BLOCK_SIZE=kv_cache.shape[2], GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HALF=head // 2,
        HALF_PAD=pairs_padded(head), KEY_TILE=KEY_TILE)
    decode_reduce_kernel[(count, heads)](
        output, partial, lse, plan.query_start, rows.row, rows.splits, output.stride(0), output.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), HEAD=head,
        HEAD_PAD=triton.next_power_of_2(head), SPLITS_PAD=triton.next_power_of_2(rows.splits))

