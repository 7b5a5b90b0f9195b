"""The attention backend: a pre-rotation paged KV cache and per-request position rules.

Keys are written to the cache **unrotated** (K and V planes only, as stock vLLM) and rotated
inside attention by each request's own rule. Every method is one general rule per row
(see :class:`rope_plugins.requests.RowTables`): a key at relative position ``r = m - n``

* inside the window (``r < w``) scores ``(R(m θ) q)^T (R(n θ) k)`` (plain RoPE);
* beyond it scores ``(R((w + (m - w) ρ) θ) q)^T (R(n ρ θ) k)``: ReRoPE has ``ρ = 0``, so the
  old keys are read raw against one pre-rotated query; Leaky ReRoPE ``ρ = 1/k``; frequency
  methods are all "beyond" (``w = 0, ρ = 1``) with their own ``θ``.

Decode rows (one query each) are batched together in one call of the C++ kernel
(``csrc/decode_attention.cpp``): it reads the paged cache in place, once, scoring each key
under its row's rule (rotating only band keys, and old keys only when ``ρ != 0``), with the
keys split into chunks across cores and the partial softmaxes merged.
:meth:`RopeExtendAttentionImpl.decode_reference` is the same computation in PyTorch.
Prefill rows use PyTorch's fused CPU flash attention, unmasked: the near band (see
:meth:`RopeExtendAttentionImpl.near_band`), and the far part as a causal call shifted by ``w``
plus a dense call for keys older than the chunk; the partial results are merged by their
log-sum-exp. Work is one attention plus the band, never two full score matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .native import decode_kernel
from .requests import RequestSettingsTracker, log_n_factor
from .rotary import rotate_by

BACKEND_NAME = "ROPE_EXTEND"
PREFILL_TILE = 256  # queries per near-band tile in prefill (at most the window)
FAR_TABLES_KEPT = 16  # far-key rotation tables kept between steps (one per distinct (θ, ρ))


def cos_sin(angle: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of float64 angles, cast for the model (angles stay exact to 1e-12)."""
    return angle.cos().to(dtype), angle.sin().to(dtype)


@dataclass
class PrefillRow:
    """One request with more than one query token this step, and its precomputed plan."""

    tokens: slice  # its query tokens in the step's flat token order
    context: int  # tokens already in the cache before this chunk
    seq_len: int  # context + chunk
    row: int  # batch row (block table)
    window: int
    # far part (keys n <= m - w): the first query that has any, and the key rotation n ρ θ
    first_far: int
    far_keys: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [seq_len, 1, d/2]; None if ρ = 0
    # near band (0 <= m - n < w): "young" queries (m < w) see every earlier key; the rest go in
    # tiles of `tile` queries, each against its own tile (causal), the w - tile keys before it
    # (all visible) and the tile - 1 keys before those (a reversed triangle)
    young: int = 0
    tile: int = 0
    tiles: int = 0
    band_start: int = 0  # first key position any near query sees
    band_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of n θ for n = band_start .. seq_len-1, [n, 1, d/2]

    @property
    def chunk(self) -> int:
        return self.tokens.stop - self.tokens.start


@dataclass
class RopeExtendMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [R, max_blocks]
    query_scale: torch.Tensor  # [T] log-n x YaRN temperature, model dtype
    near_query: tuple[torch.Tensor, torch.Tensor]  # cos, sin of m θ, [T, 1, d/2]
    far_query: tuple[torch.Tensor, torch.Tensor]  # cos, sin of (w + (m - w) ρ) θ, [T, 1, d/2]
    prefill: list[PrefillRow]
    # decode rows, batched over rows and cache blocks
    decode_tokens: torch.Tensor  # [Rd] token index of each decode row
    decode_block_ids: torch.Tensor  # [Rd, nb]
    decode_keep: torch.Tensor  # [Rd, nb*bs] keys each row attends to
    # far-key rotations n ρ θ: one table per distinct setting with ρ != 0, cos, sin [U, nb*bs, d/2],
    # and each row's table (-1: ρ = 0, old keys read raw)
    decode_far_keys: tuple[torch.Tensor, torch.Tensor] | None
    decode_far_table: torch.Tensor | None  # [Rd] int64
    decode_band: tuple[torch.Tensor, ...] | None  # block [Rd, W], offset [Rd, W], target [Rd, W], cos, sin [Rd, W, 1, d/2]
    decode_rules: tuple[torch.Tensor, ...] | None = None  # seq_lens, window, band start [Rd] (kernel)


class RopeExtendMetadataBuilder(AttentionMetadataBuilder[RopeExtendMetadata]):
    """Turns the step's rows and each row's settings into rotation tables, masks and index
    plans, once per step for all layers."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vllm_config = vllm_config
        self.dtype = vllm_config.model_config.dtype
        self.head_dim = kv_cache_spec.head_size
        self.block_size = kv_cache_spec.block_size
        query_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.group = query_heads // kv_cache_spec.num_kv_heads
        self.prefill_tile = PREFILL_TILE
        self.far_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tracker(self) -> RequestSettingsTracker:
        tracker = RequestSettingsTracker.for_config(self.vllm_config)
        if tracker is None:
            raise RuntimeError(
                "rope_plugins: the request-settings tracker is not installed; build the engine "
                "with rope_plugins.engine.engine_kwargs(...) (logits_processors=[RequestSettingsTracker])")
        return tracker

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RopeExtendMetadata:
        common = common_attn_metadata
        rows = common.num_reqs
        return self.plan(self.tracker().tables, common.query_start_loc_cpu[: rows + 1].to(torch.int64),
                         common.seq_lens[:rows].to("cpu", torch.int64), common.block_table_tensor,
                         common.slot_mapping[: common.num_actual_tokens])

    def plan(self, tables, starts: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor) -> RopeExtendMetadata:
        """The step's metadata from plain tensors: row starts ``[R+1]`` in the flat token order,
        sequence lengths ``[R]``, block table, slots, and the rows' settings tables."""
        rows, tokens = seq_lens.numel(), int(starts[-1])
        theta, window, leak = tables.theta[:rows], tables.window[:rows], tables.leak[:rows]
        query_lens = starts[1:] - starts[:-1]
        token_row = torch.repeat_interleave(torch.arange(rows), query_lens, output_size=tokens)
        # position of each token: the request's context plus its offset in the chunk
        positions = (seq_lens - query_lens)[token_row] + torch.arange(tokens) - starts[:-1][token_row]

        token_theta = theta[token_row]  # [T, d/2]
        token_window = window[token_row].to(torch.float64)
        far_position = token_window + (positions - token_window) * leak[token_row]
        query_scale = log_n_factor(positions, tables.log_n_length[:rows][token_row]) * tables.query_factor[:rows][token_row]

        decode = (query_lens == 1).nonzero().flatten()
        prefill = [self.prefill_plan(int(r), starts, query_lens, seq_lens, window, leak, theta)
                   for r in (query_lens > 1).nonzero().flatten().tolist()]
        return RopeExtendMetadata(
            num_actual_tokens=tokens,
            slot_mapping=slot_mapping,
            block_table=block_table,
            query_scale=query_scale.to(self.dtype),
            near_query=cos_sin((positions[:, None].double() * token_theta)[:, None], self.dtype),
            far_query=cos_sin((far_position[:, None] * token_theta)[:, None], self.dtype),
            prefill=prefill,
            decode_tokens=starts[:-1][decode],
            **self.decode_plan(decode, seq_lens, window, leak, theta, block_table),
        )

    def far_key_table(self, theta: torch.Tensor, leak: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``n ρ θ`` for key positions ``n < length`` ``[length, d/2]``. Computed once
        per setting (and per doubling of the length), not every step: keys keep their angle."""
        key = (leak, theta.numpy().tobytes())
        table = self.far_tables.pop(key, None)  # re-inserted below: the dict is kept in use order
        if table is None or table[0].shape[0] < length:
            capacity = max(1024, 1 << (length - 1).bit_length())
            table = cos_sin(torch.arange(capacity, dtype=torch.float64)[:, None] * (leak * theta), self.dtype)
        self.far_tables[key] = table
        while len(self.far_tables) > FAR_TABLES_KEPT:
            self.far_tables.pop(next(iter(self.far_tables)))
        return table[0][:length], table[1][:length]

    def decode_plan(self, decode, seq_lens, window, leak, theta, block_table) -> dict:
        """Index plan for all decode rows: blocks to read, keys to keep, the near band."""
        rows, block_size = decode.numel(), self.block_size
        if rows == 0:
            empty = torch.empty(0, 0, dtype=torch.int64)
            return dict(decode_block_ids=empty, decode_keep=empty.bool(), decode_far_keys=None, decode_far_table=None,
                        decode_band=None, decode_rules=None)
        seq = seq_lens[decode]
        blocks = -(-int(seq.max()) // block_size)
        position = torch.arange(blocks * block_size)
        keep = position[None, :] < seq[:, None]
        row_theta, row_leak, row_window = theta[decode], leak[decode], window[decode]
        far_table, table_of, table_rows = torch.full((rows,), -1, dtype=torch.int64), {}, []
        for r in (row_leak != 0).nonzero().flatten().tolist():
            setting = (float(row_leak[r]), row_theta[r].numpy().tobytes())
            if setting not in table_of:
                table_of[setting] = len(table_rows)
                table_rows.append(r)  # the row whose θ, ρ build this table
            far_table[r] = table_of[setting]
        far_keys = None
        if table_rows:
            tables = [self.far_key_table(row_theta[r], float(row_leak[r]), blocks * block_size) for r in table_rows]
            far_keys = torch.stack([cos for cos, _ in tables]), torch.stack([sin for _, sin in tables])
        band_width = min(int(row_window.max()), int(seq.max()))
        band = None
        band_start = (seq - band_width).clamp(min=0)
        if band_width > 0:
            query_position = seq - 1
            band_position = band_start[:, None] + torch.arange(band_width)  # [Rd, W]
            in_band = (band_position < seq[:, None]) & (query_position[:, None] - band_position < row_window[:, None])
            band_position = band_position.clamp(max=blocks * block_size - 1)
            # near keys take their band score, the rest of the band goes to a spare column
            target = torch.where(in_band, band_position, blocks * block_size)
            band_cos, band_sin = cos_sin((band_position.double()[..., None] * row_theta[:, None, :])[:, :, None], self.dtype)
            band = (band_position // block_size, band_position % block_size, target, band_cos, band_sin)
        return dict(decode_block_ids=block_table[decode, :blocks], decode_keep=keep, decode_far_keys=far_keys,
                    decode_far_table=far_table, decode_band=band, decode_rules=(seq, row_window, band_start))

    def prefill_plan(self, row, starts, query_lens, seq_lens, window, leak, theta) -> PrefillRow:
        chunk, seq_len = int(query_lens[row]), int(seq_lens[row])
        context, w, row_leak, row_theta = seq_len - chunk, int(window[row]), float(leak[row]), theta[row]
        far_keys = None
        if row_leak != 0:
            cos, sin = self.far_key_table(row_theta, row_leak, seq_len)
            far_keys = cos[:, None], sin[:, None]
        plan = PrefillRow(slice(int(starts[row]), int(starts[row + 1])), context, seq_len, row, w,
                          first_far=max(0, w - context), far_keys=far_keys)
        if w == 0:
            return plan
        plan.young = min(max(w - context, 0), chunk)
        old = chunk - plan.young
        plan.tile = min(self.prefill_tile, w, old) if old else 0
        plan.tiles = -(-old // plan.tile) if old else 0
        plan.band_start = max(0, context - w + 1)
        positions = torch.arange(plan.band_start, seq_len, dtype=torch.float64)
        plan.band_keys = cos_sin((positions[:, None] * row_theta)[:, None], self.dtype)
        return plan


def merge_partials(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact softmax attention over the union of disjoint key sets from each part's output
    ``[..., L, d]`` and log-sum-exp ``[..., L]`` (float32)."""
    if len(outputs) == 1:
        return outputs[0]
    lse = torch.stack(lses)
    weights = torch.exp(lse - lse.max(dim=0).values).unsqueeze(-1)  # [parts, ..., L, 1]
    merged = (torch.stack([o.float() for o in outputs]) * weights).sum(0) / weights.sum(0)
    return merged.to(outputs[0].dtype)


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    causal: bool = False, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused CPU attention with its log-sum-exp. query ``[B, H, L, d]``, key/value
    ``[B, H, S, d]`` (heads already matched), ``mask`` additive ``[B, 1, L, S]``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=mask, scale=scale)


def heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """``[..., L, H, d]`` to ``[..., H * group, L, d]``, repeating KV heads for GQA."""
    x = x.transpose(-3, -2)
    return x.repeat_interleave(group, dim=-3) if group > 1 else x


class RopeExtendAttentionImpl(AttentionImpl[RopeExtendMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("rope_plugins attention: no ALiBi, sliding window or soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("rope_plugins attention serves decoder self-attention only")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.use_kernel = True  # the tests switch it off to compare against the PyTorch path
        decode_kernel()  # build or load it now, at model construction, not inside the first step

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        """Unrotated keys and values into their slots: kv_cache ``[blocks, kv_heads, block, 2d]``."""
        block_size = kv_cache.shape[2]
        slots = slot_mapping.long()
        kv_cache[slots // block_size, :, slots % block_size] = torch.cat((key, value), dim=-1)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: RopeExtendMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output
        meta = attn_metadata
        tokens = meta.num_actual_tokens
        query, key, value = query[:tokens], key[:tokens], value[:tokens]
        if self.kv_sharing_target_layer_name is None:
            self.write_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.decode_tokens.numel():
            output[meta.decode_tokens] = self.decode(query[meta.decode_tokens], kv_cache, meta)
        for row in meta.prefill:
            scaled = query[row.tokens] * meta.query_scale[row.tokens, None, None]
            near_query = rotate_by(scaled, meta.near_query[0][row.tokens], meta.near_query[1][row.tokens])
            far_query = rotate_by(scaled, meta.far_query[0][row.tokens], meta.far_query[1][row.tokens])
            output[row.tokens] = self.prefill(near_query, far_query, kv_cache, meta, row)
        return output

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: RopeExtendMetadata) -> torch.Tensor:
        """All decode rows at once from their unrotated queries ``[Rd, heads, d]``. The C++
        kernel reads the paged cache in place and rotates as it goes; :meth:`decode_reference`
        is the same computation in PyTorch."""
        kernel = decode_kernel() if kv_cache.dtype == torch.float32 and self.use_kernel else None
        if kernel is None:
            return self.decode_reference(query, kv_cache, meta)
        seq_lens, window, band_start = meta.decode_rules
        rows, half = query.shape[0], self.head_size // 2
        tokens = meta.decode_tokens
        query_cos = torch.stack((meta.near_query[0][tokens, 0], meta.far_query[0][tokens, 0]), dim=1)
        query_sin = torch.stack((meta.near_query[1][tokens, 0], meta.far_query[1][tokens, 0]), dim=1)
        empty = kv_cache.new_empty(0)
        near_cos, near_sin = (meta.decode_band[3], meta.decode_band[4]) if meta.decode_band is not None else (empty, empty)
        far_cos, far_sin = meta.decode_far_keys if meta.decode_far_keys is not None else (empty, empty)
        as_rows = lambda table: table.reshape(rows, -1, half) if table.numel() else empty  # noqa: E731
        return kernel.decode_attention(
            query, meta.query_scale[tokens], query_cos, query_sin, kv_cache, meta.decode_block_ids,
            seq_lens, window, band_start, as_rows(near_cos), as_rows(near_sin), far_cos, far_sin,
            meta.decode_far_table, self.scale)

    def decode_reference(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: RopeExtendMetadata) -> torch.Tensor:
        """All decode rows at once, block by block of the paged cache: ``[Rd, heads, d]``."""
        d, kv, group = self.head_size, self.num_kv_heads, self.group
        tokens = meta.decode_tokens
        scaled = query * meta.query_scale[tokens, None, None]
        near_query = rotate_by(scaled, meta.near_query[0][tokens], meta.near_query[1][tokens])
        far_query = rotate_by(scaled, meta.far_query[0][tokens], meta.far_query[1][tokens])
        blocks = kv_cache[meta.decode_block_ids]  # [Rd, nb, kv, bs, 2d]: the one copy of the cache
        rows, num_blocks, _, block_size, _ = blocks.shape
        keys, values = blocks[..., :d], blocks[..., d:]
        if meta.decode_far_keys is not None:  # rows with ρ = 0 take the identity rotation
            table = meta.decode_far_table.clamp(min=0)
            identity = (meta.decode_far_table < 0)[:, None, None]
            cos = torch.where(identity, 1.0, meta.decode_far_keys[0][table]).view(rows, num_blocks, 1, block_size, -1)
            sin = torch.where(identity, 0.0, meta.decode_far_keys[1][table]).view(rows, num_blocks, 1, block_size, -1)
            keys_far = rotate_by(keys, cos, sin)
        else:
            keys_far = keys  # ReRoPE: old keys are read raw
        q_far = far_query.view(rows, 1, kv, group, d)
        scores = torch.matmul(q_far, keys_far.transpose(-1, -2))  # [Rd, nb, kv, g, bs]
        scores = scores.permute(0, 2, 3, 1, 4).reshape(rows, kv, group, num_blocks * block_size)
        if meta.decode_band is not None:
            band_block, band_offset, target, band_cos, band_sin = meta.decode_band
            row_index = torch.arange(rows)[:, None]
            band_keys = rotate_by(keys[row_index, band_block, :, band_offset], band_cos, band_sin)  # [Rd, W, kv, d]
            q_near = near_query.view(rows, kv, group, d)
            band_scores = torch.einsum("rkgd,rwkd->rkgw", q_near, band_keys)
            scores = torch.cat((scores, scores.new_zeros(rows, kv, group, 1)), dim=-1)
            scores.scatter_(-1, target[:, None, None, :].expand_as(band_scores), band_scores)
            scores = scores[..., :-1]
        scores = (scores * self.scale).masked_fill(~meta.decode_keep[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        weights = weights.view(rows, kv, group, num_blocks, block_size).permute(0, 3, 1, 2, 4)
        out = torch.matmul(weights, values).sum(dim=1)  # [Rd, kv, g, d]
        return out.reshape(rows, self.num_heads, d)

    def prefill(self, near_query: torch.Tensor, far_query: torch.Tensor, kv_cache: torch.Tensor,
                meta: RopeExtendMetadata, row: PrefillRow) -> torch.Tensor:
        """One request's chunk of ``L`` queries at positions ``context .. seq_len-1``: ``[L, heads, d]``."""
        d, chunk, window = self.head_size, row.chunk, row.window
        block_size = kv_cache.shape[2]
        blocks = kv_cache[meta.block_table[row.row, : -(-row.seq_len // block_size)]]  # [nb, kv, bs, 2d]
        cached = blocks.transpose(1, 2).reshape(-1, self.num_kv_heads, 2 * d)[: row.seq_len]
        keys, values = cached[..., :d], cached[..., d:]

        if row.first_far < chunk:  # far part: queries m >= w see keys n <= m - w
            far_keys = rotate_by(keys, *row.far_keys) if row.far_keys is not None else keys
            q = heads_first(far_query[row.first_far:])[None]
            newest = row.context + row.first_far - window  # first key of the causal (triangle) part
            visible = slice(newest, newest + chunk - row.first_far)
            out, lse = flash_attention(q, heads_first(far_keys[visible], self.group)[None],
                                       heads_first(values[visible], self.group)[None], self.scale, causal=True)
            parts_out, parts_lse = [out], [lse]
            if newest > 0:  # keys older than every query's window: all visible
                out, lse = flash_attention(q, heads_first(far_keys[:newest], self.group)[None],
                                           heads_first(values[:newest], self.group)[None], self.scale)
                parts_out.append(out), parts_lse.append(lse)
            far_out = merge_partials(parts_out, parts_lse)[0]  # [H, L - first_far, d]
            far_lse = torch.logsumexp(torch.stack(parts_lse), dim=0)[0]
            if window == 0:
                return far_out.transpose(0, 1)
        near_out, near_lse = self.near_band(near_query, keys, values, row)
        if row.first_far < chunk:
            merged = merge_partials([near_out[:, row.first_far:], far_out], [near_lse[:, row.first_far:], far_lse])
            near_out = torch.cat((near_out[:, : row.first_far], merged), dim=1)
        return near_out.transpose(0, 1)

    def near_band(self, near_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  row: PrefillRow) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain-RoPE attention of each query to the keys within its window, ``0 <= m - n < w``,
        as unmasked fused calls only: young queries (``m < w``) are ordinary causal attention;
        the others go in tiles (batched), each tile against itself (causal), against the
        ``w - tile`` keys before it (dense) and the ``tile - 1`` keys before those (a triangle,
        causal once queries and keys are both reversed). Returns ``[H, L, d]`` and the
        log-sum-exp ``[H, L]``."""
        d, kv, group, tile, tiles, w = self.head_size, self.num_kv_heads, self.group, row.tile, row.tiles, row.window
        heads = kv * group
        start, context, young = row.band_start, row.context, row.young
        band_keys = rotate_by(keys[start:], *row.band_keys)  # [seq_len - start, kv, d]
        band_values = values[start:]
        outs, lses = [], []
        if young:  # m < w: every key 0 .. m, i.e. the cached context and a causal square
            q = heads_first(near_query[:young])[None]
            new = slice(context - start, context - start + young)
            parts = [flash_attention(q, heads_first(band_keys[new], group)[None],
                                     heads_first(band_values[new], group)[None], self.scale, causal=True)]
            if context:
                parts.append(flash_attention(q, heads_first(band_keys[:context], group)[None],
                                             heads_first(band_values[:context], group)[None], self.scale))
            outs.append(merge_partials(*zip(*parts))[0])
            lses.append(torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)[0])
        if tiles:
            first = context + young - start  # index of the first tile's first query position
            pad = tiles * tile - (row.chunk - young)
            band_keys = torch.nn.functional.pad(band_keys, (0, 0, 0, 0, 0, pad)).contiguous()
            band_values = torch.nn.functional.pad(band_values, (0, 0, 0, 0, 0, pad)).contiguous()

            def tile_view(source: torch.Tensor, offset: int, length: int) -> torch.Tensor:
                """Keys ``offset + t*tile .. + length`` for every tile t: ``[tiles, length, kv, d]``."""
                return source.as_strided((tiles, length, kv, d), (tile * kv * d, kv * d, d, 1), offset * kv * d)

            queries = torch.nn.functional.pad(near_query[young:], (0, 0, 0, 0, 0, pad)).view(tiles, tile, heads, d)
            diagonal = flash_attention(heads_first(queries), heads_first(tile_view(band_keys, first, tile), group),
                                       heads_first(tile_view(band_values, first, tile), group), self.scale, causal=True)
            parts_out, parts_lse = [diagonal[0]], [diagonal[1]]  # [tiles, H, tile, d], [tiles, H, tile]
            if w > tile:  # keys tile .. w-1 positions back: visible to the whole tile
                folded = queries.view(tiles, tile, kv, group, d).permute(0, 2, 3, 1, 4).reshape(tiles, kv, group * tile, d)
                out, lse = flash_attention(folded, tile_view(band_keys, first - w + tile, w - tile).transpose(1, 2),
                                           tile_view(band_values, first - w + tile, w - tile).transpose(1, 2), self.scale)
                parts_out.append(out.view(tiles, kv, group, tile, d).reshape(tiles, heads, tile, d))
                parts_lse.append(lse.reshape(tiles, heads, tile))
            if tile > 1:  # query i sees key j of the tile - 1 before those iff j >= i: reversed, causal
                reverse = lambda x: x.flip(1)  # noqa: E731
                out, lse = flash_attention(
                    heads_first(reverse(queries[:, : tile - 1])),
                    heads_first(reverse(tile_view(band_keys, first - w + 1, tile - 1)), group),
                    heads_first(reverse(tile_view(band_values, first - w + 1, tile - 1)), group), self.scale, causal=True)
                parts_out.append(torch.nn.functional.pad(out.flip(2), (0, 0, 0, 1)))
                parts_lse.append(torch.nn.functional.pad(lse.flip(2), (0, 1), value=float("-inf")))
            merged = merge_partials(parts_out, parts_lse)  # [tiles, H, tile, d]
            lse = torch.logsumexp(torch.stack(parts_lse), dim=0)
            old = row.chunk - young
            outs.append(merged.permute(1, 0, 2, 3).reshape(heads, tiles * tile, d)[:, :old])
            lses.append(lse.permute(1, 0, 2).reshape(heads, tiles * tile)[:, :old])
        return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


class RopeExtendAttentionBackend(AttentionBackend):
    """Attention for the RoPE-extension model: owns the cache write and the read."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[RopeExtendAttentionImpl]:
        return RopeExtendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RopeExtendMetadataBuilder]:
        return RopeExtendMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # token-major blocks: a block's tokens gather into [tokens, kv_heads, 2d] without a copy
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
