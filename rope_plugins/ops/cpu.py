"""The attention's CPU ops on the pre-rotation paged cache.

Prefill rows of a float32 model take the C++ one-pass kernel (:func:`prefill_kernel`: keys
rotated once per chunk and laid out in tiles, then near, far and straddling tiles in one
walk). Otherwise, and as its reference in the tests, PyTorch's fused CPU flash attention, unmasked: the near band (plain RoPE,
``0 <= m - n < w``, see :func:`near_band`) and the far part (the far query against keys at
their far angle, or raw under ReRoPE) as a causal call shifted by ``w`` plus a dense call for
keys older than the chunk; the parts are merged by their log-sum-exp. Work is one attention
plus the band, never two full score matrices.

Decode rows are batched together, in one call of the C++ kernel when the cache is float32
(:mod:`rope_plugins.ops.native`), otherwise in :func:`decode_torch`, the same computation
in PyTorch and the kernel's reference in the tests.
"""

from __future__ import annotations

import torch

from rope_plugins.attention.planner import KEY_TILE, DecodePlan, PrefillRow, QueryPlan, Rotation
from rope_plugins.ops import native
from rope_plugins.ops.merge import merge_partials
from rope_plugins.rules.rotary import rotate_by


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused CPU attention with its log-sum-exp. query ``[B, H, L, d]``, key/value
    ``[B, H, S, d]`` (heads already matched)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)


def heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """``[..., L, H, d]`` to ``[..., H * group, L, d]``, repeating KV heads for GQA."""
    x = x.transpose(-3, -2)
    return x.repeat_interleave(group, dim=-3) if group > 1 else x


def rotated_queries(query: torch.Tensor, plan: QueryPlan, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled query of ``tokens`` rotated to its near and its far angle."""
    scaled = query * plan.scale[tokens, None, None]
    near, far = plan.near[tokens], plan.far[tokens]
    return rotate_by(scaled, near.cos, near.sin), rotate_by(scaled, far.cos, far.sin)


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                use_kernel: bool = True) -> None:
    """Unrotated keys and values into their slots: kv_cache ``[blocks, kv_heads, block, 2d]``
    (one C++ call where it is built)."""
    if use_kernel and native.kernels() is not None:
        native.write_cache(key=key, value=value, kv_cache=kv_cache, slots=slot_mapping)
        return
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    kv_cache[slots // block_size, :, slots % block_size] = torch.cat((key, value), dim=-1)


def sequence_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's unrotated keys and values, ``[seq_len, kv, d]`` each."""
    blocks = kv_cache[block_ids[: -(-seq_len // kv_cache.shape[2])]]  # [nb, kv, bs, 2d]
    cached = blocks.transpose(1, 2).reshape(-1, kv_cache.shape[1], kv_cache.shape[3])[:seq_len]
    head_dim = kv_cache.shape[3] // 2
    return cached[..., :head_dim], cached[..., head_dim:]


def uses_prefill_kernel(query: torch.Tensor) -> bool:
    """The C++ prefill serves float32 with head sizes in whole key tiles, where it is built."""
    return (query.dtype == torch.float32 and query.shape[-1] % KEY_TILE == 0
            and native.kernels() is not None)


def prefill_kernel(query: torch.Tensor, queries: QueryPlan, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   row: PrefillRow, *, scale: float) -> torch.Tensor:
    """:func:`prefill` in one pass of the C++ kernel, from the row's unrotated queries
    ``[L, heads, d]`` (the kernel scales and turns them as it reads them) and the paged cache:
    its keys read out once per chunk at their far angle (raw under ReRoPE) and, for the band, at
    their near angle, in tiles whose 32 keys of one dimension are one contiguous vector."""
    tile, half = KEY_TILE, query.shape[-1] // 2
    tiles = -(-row.seq_len // tile)
    flat = lambda rotation: Rotation(cos=rotation.cos.reshape(-1, half), sin=rotation.sin.reshape(-1, half))  # noqa: E731
    far_keys = native.cache_key_tiles(kv_cache=kv_cache, block_ids=block_ids, first=0, count=row.seq_len,
                                      rotation=flat(row.far_keys) if row.far_keys is not None else None, origin=0,
                                      tiles=tiles)
    near_origin, near_keys = 0, kv_cache.new_empty(0)
    if row.window:
        near_origin = row.band_start // tile * tile
        near_keys = native.cache_key_tiles(kv_cache=kv_cache, block_ids=block_ids, first=row.band_start,
                                           count=row.seq_len - row.band_start, rotation=flat(row.band_keys),
                                           origin=near_origin, tiles=tiles - near_origin // tile)
    inputs = native.prefill_inputs(query_scale=queries.scale[row.tokens], near=flat(queries.near[row.tokens]),
                                   far=flat(queries.far[row.tokens]), context=row.context, window=row.window,
                                   near_origin=near_origin)
    return native.prefill_attention(
        inputs, query=query, near_keys=near_keys, far_keys=far_keys,
        values=native.cache_values(kv_cache=kv_cache, block_ids=block_ids, seq_len=row.seq_len), scale=scale)


def prefill(near_query: torch.Tensor, far_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            row: PrefillRow, *, scale: float, group: int) -> torch.Tensor:
    """One request's chunk of ``L`` queries at positions ``context .. seq_len-1``: ``[L, heads, d]``,
    from PyTorch's flash attention (the near band and the far part merged by log-sum-exp)."""
    if row.first_far >= row.chunk:  # every query inside the window: the band is all
        return near_band(near_query, keys, values, row, scale=scale, group=group)[0].transpose(0, 1)
    far_out, far_lse = far_part(far_query[row.first_far:], keys, values, row, scale=scale, group=group)
    if row.window == 0:
        return far_out.transpose(0, 1)
    near_out, near_lse = near_band(near_query, keys, values, row, scale=scale, group=group)
    merged, _ = merge_partials([near_out[:, row.first_far:], far_out], [near_lse[:, row.first_far:], far_lse])
    return torch.cat((near_out[:, : row.first_far], merged), dim=1).transpose(0, 1)


def far_part(far_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: PrefillRow, *, scale: float,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``m >= w`` against keys ``n <= m - w``: a causal call on the keys shifted by
    ``w`` and a dense one for keys older than every query's window. ``[H, L', d]``, ``[H, L']``."""
    far_keys = rotate_by(keys, row.far_keys.cos, row.far_keys.sin) if row.far_keys is not None else keys
    query = heads_first(far_query)[None]
    newest = row.context + row.first_far - row.window  # first key of the causal (triangle) part
    visible = slice(newest, newest + far_query.shape[0])
    parts = [flash_attention(query, heads_first(far_keys[visible], group)[None],
                             heads_first(values[visible], group)[None], scale, causal=True)]
    if newest > 0:
        parts.append(flash_attention(query, heads_first(far_keys[:newest], group)[None],
                                     heads_first(values[:newest], group)[None], scale))
    out, lse = merge_partials(*zip(*parts))
    return out[0], lse[0]


def near_band(near_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: PrefillRow, *, scale: float,
              group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-RoPE attention of each query to the keys within its window, ``0 <= m - n < w``:
    young queries (``m < w``) as ordinary causal attention, the others in tiles. Returns
    ``[H, L, d]`` and the log-sum-exp ``[H, L]``."""
    band_keys = rotate_by(keys[row.band_start:], row.band_keys.cos, row.band_keys.sin)  # [seq_len - start, kv, d]
    band_values = values[row.band_start:]
    outs, lses = [], []
    if row.young:
        out, lse = young_queries(near_query[: row.young], band_keys, band_values, row, scale=scale, group=group)
        outs.append(out), lses.append(lse)
    if row.tiles:
        out, lse = tiled_band(near_query[row.young:], band_keys, band_values, row, scale=scale, group=group)
        outs.append(out), lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def young_queries(query: torch.Tensor, band_keys: torch.Tensor, band_values: torch.Tensor, row: PrefillRow, *,
                  scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``m < w`` see every key ``0 .. m``: the cached context and a causal square."""
    q = heads_first(query)[None]
    context = row.context - row.band_start
    new = slice(context, context + row.young)
    parts = [flash_attention(q, heads_first(band_keys[new], group)[None], heads_first(band_values[new], group)[None],
                             scale, causal=True)]
    if row.context:
        parts.append(flash_attention(q, heads_first(band_keys[:context], group)[None],
                                     heads_first(band_values[:context], group)[None], scale))
    out, lse = merge_partials(*zip(*parts))
    return out[0], lse[0]


def tiled_band(query: torch.Tensor, band_keys: torch.Tensor, band_values: torch.Tensor, row: PrefillRow, *,
               scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The older queries in tiles (batched): each tile against itself (causal), against the
    ``w - tile`` keys before it (dense) and the ``tile - 1`` keys before those (a triangle,
    causal once queries and keys are both reversed), as unmasked fused calls only."""
    tile, tiles, window = row.tile, row.tiles, row.window
    old, (kv, d), heads = query.shape[0], band_keys.shape[1:], query.shape[1]
    first = row.context + row.young - row.band_start  # the first tile's first query position in the band
    pad = tiles * tile - old
    band_keys = torch.nn.functional.pad(band_keys, (0, 0, 0, 0, 0, pad)).contiguous()
    band_values = torch.nn.functional.pad(band_values, (0, 0, 0, 0, 0, pad)).contiguous()

    def tile_view(source: torch.Tensor, offset: int, length: int) -> torch.Tensor:
        """Keys ``offset + t*tile .. + length`` for every tile t: ``[tiles, length, kv, d]``."""
        return source.as_strided((tiles, length, kv, d), (tile * kv * d, kv * d, d, 1), offset * kv * d)

    queries = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, pad)).view(tiles, tile, heads, d)
    parts = [flash_attention(heads_first(queries), heads_first(tile_view(band_keys, first, tile), group),
                             heads_first(tile_view(band_values, first, tile), group), scale, causal=True)]
    if window > tile:  # keys tile .. w-1 positions back: visible to the whole tile
        folded = queries.view(tiles, tile, kv, group, d).permute(0, 2, 3, 1, 4).reshape(tiles, kv, group * tile, d)
        out, lse = flash_attention(folded, tile_view(band_keys, first - window + tile, window - tile).transpose(1, 2),
                                   tile_view(band_values, first - window + tile, window - tile).transpose(1, 2), scale)
        parts.append((out.view(tiles, kv, group, tile, d).reshape(tiles, heads, tile, d), lse.reshape(tiles, heads, tile)))
    if tile > 1:  # query i sees key j of the tile - 1 before those iff j >= i: reversed, causal
        out, lse = flash_attention(
            heads_first(queries[:, : tile - 1].flip(1)),
            heads_first(tile_view(band_keys, first - window + 1, tile - 1).flip(1), group),
            heads_first(tile_view(band_values, first - window + 1, tile - 1).flip(1), group), scale, causal=True)
        parts.append((torch.nn.functional.pad(out.flip(2), (0, 0, 0, 1)),
                      torch.nn.functional.pad(lse.flip(2), (0, 1), value=float("-inf"))))
    merged, lse = merge_partials(*zip(*parts))  # [tiles, H, tile, d], [tiles, H, tile]
    return (merged.permute(1, 0, 2, 3).reshape(heads, tiles * tile, d)[:, :old],
            lse.permute(1, 0, 2).reshape(heads, tiles * tile)[:, :old])


def decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, queries: QueryPlan, *, scale: float,
           use_kernel: bool = True) -> torch.Tensor:
    """All decode rows at once from their unrotated queries ``[Rd, heads, d]``: the C++ kernel
    for a float32 cache (it reads the paged cache in place and rotates as it goes), else
    :func:`decode_torch`."""
    if not (use_kernel and kv_cache.dtype == torch.float32 and native.kernels() is not None):
        return decode_torch(query, kv_cache, plan, queries, scale=scale)
    return native.decode_attention(plan.kernel_inputs, query=query, kv_cache=kv_cache, scale=scale)


def decode_torch(query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, queries: QueryPlan, *,
                 scale: float) -> torch.Tensor:
    """All decode rows at once, block by block of the paged cache: ``[Rd, heads, d]``."""
    rows, heads, d = query.shape
    near_query, far_query = rotated_queries(query, queries, plan.tokens)
    blocks = kv_cache[plan.block_ids]  # [Rd, nb, kv, bs, 2d]: the one copy of the cache
    _, num_blocks, kv, block_size, _ = blocks.shape
    group = heads // kv
    keys, values = blocks[..., :d], blocks[..., d:]
    if plan.far_keys is not None:  # rows with ρ = 0 take the identity rotation
        table = plan.far_keys.table_of_row.clamp(min=0)
        identity = (plan.far_keys.table_of_row < 0)[:, None, None]
        rotation = plan.far_keys.rotation
        cos = torch.where(identity, 1.0, rotation.cos[table]).view(rows, num_blocks, 1, block_size, -1)
        sin = torch.where(identity, 0.0, rotation.sin[table]).view(rows, num_blocks, 1, block_size, -1)
        far_keys = rotate_by(keys, cos, sin)
    else:
        far_keys = keys  # ReRoPE: old keys are read raw
    scores = torch.matmul(far_query.view(rows, 1, kv, group, d), far_keys.transpose(-1, -2))  # [Rd, nb, kv, g, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(rows, kv, group, num_blocks * block_size)
    if plan.band is not None:
        band = plan.band
        band_keys = rotate_by(keys[torch.arange(rows)[:, None], band.block, :, band.offset], band.keys.cos,
                              band.keys.sin)  # [Rd, W, kv, d]
        band_scores = torch.einsum("rkgd,rwkd->rkgw", near_query.view(rows, kv, group, d), band_keys)
        scores = torch.cat((scores, scores.new_zeros(rows, kv, group, 1)), dim=-1)
        scores.scatter_(-1, band.target[:, None, None, :].expand_as(band_scores), band_scores)
        scores = scores[..., :-1]
    scores = (scores * scale).masked_fill(~plan.keep[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    weights = weights.view(rows, kv, group, num_blocks, block_size).permute(0, 3, 1, 2, 4)
    return torch.matmul(weights, values).sum(dim=1).reshape(rows, heads, d)  # [Rd, kv, g, d] summed over blocks
