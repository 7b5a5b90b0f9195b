"""The attention backend: a pre-rotation paged KV cache and per-request position rules.

Keys are written to the cache **unrotated** (K and V planes only, as stock vLLM) and rotated
inside attention by each request's own rule. Every method is one general rule per row
(see :class:`rope_plugins.requests.RowTables`): a key at relative position ``r = m - n``

* inside the window (``r < w``) scores ``(R(m θ) q)^T (R(n θ) k)`` (plain RoPE);
* beyond it scores ``(R((w + (m - w) ρ) θ) q)^T (R(n ρ θ) k)``: ReRoPE has ``ρ = 0``, so the
  old keys are read raw against one pre-rotated query; Leaky ReRoPE ``ρ = 1/k``; frequency
  methods are all "beyond" (``w = 0, ρ = 1``) with their own ``θ``.

Decode rows (one query each) are batched together: one score per cached key ("far" rule
against the whole cache), then the band of the last ``w`` keys rescored with the "near" rule,
one softmax. Prefill rows use PyTorch's fused CPU flash attention three times: the near band
(query tiles against their ``w``-wide key band), and the far part as a causal call shifted by
``w`` plus a dense call for keys older than the chunk; the partial results are merged by
their log-sum-exp. Work is one attention plus the band, never two full score matrices.
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

from .requests import RequestSettingsTracker, log_n_factor
from .rotary import rotate_by

BACKEND_NAME = "ROPE_EXTEND"
PREFILL_TILE = 256  # query rows per near-band tile in prefill


def cos_sin(angle: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of float64 angles, cast for the model (angles stay exact to 1e-12)."""
    return angle.cos().to(dtype), angle.sin().to(dtype)


@dataclass
class PrefillRow:
    """One request with more than one query token this step."""

    tokens: slice  # its query tokens in the step's flat token order
    context: int  # tokens already in the cache before this chunk
    seq_len: int  # context + chunk
    row: int  # batch row (block table, settings)
    window: int
    leak: float
    theta: torch.Tensor  # [d/2] float64


@dataclass
class RopeExtendMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [R, max_blocks]
    query_scale: torch.Tensor  # [T] log-n x YaRN temperature, model dtype
    near_query: tuple[torch.Tensor, torch.Tensor]  # cos, sin of m θ, [T, d/2]
    far_query: tuple[torch.Tensor, torch.Tensor]  # cos, sin of (w + (m - w) ρ) θ, [T, d/2]
    prefill: list[PrefillRow]
    # decode rows, batched: row index, token index, length, and per-key rotation tables
    decode_rows: torch.Tensor  # [Rd]
    decode_tokens: torch.Tensor  # [Rd]
    decode_seq_lens: torch.Tensor  # [Rd]
    decode_window: torch.Tensor  # [Rd]
    decode_far_keys: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin of n ρ θ, [Rd, S, d/2]; None if all ρ = 0
    decode_band_start: torch.Tensor  # [Rd] first key position of the near band
    decode_band_keys: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin of n θ, [Rd, W, d/2]


class RopeExtendMetadataBuilder(AttentionMetadataBuilder[RopeExtendMetadata]):
    """Turns the step's rows and each row's settings into per-token rotation tables, once
    per step for all layers."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vllm_config = vllm_config
        self.dtype = vllm_config.model_config.dtype
        self.head_dim = kv_cache_spec.head_size

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
        rows, tokens = common.num_reqs, common.num_actual_tokens
        tables = self.tracker().tables
        theta, window, leak = tables.theta[:rows], tables.window[:rows], tables.leak[:rows]

        starts = common.query_start_loc_cpu[: rows + 1].to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        seq_lens = common.seq_lens[:rows].to("cpu", torch.int64)
        token_row = torch.repeat_interleave(torch.arange(rows), query_lens, output_size=tokens)
        # position of each token: the request's context plus its offset in the chunk
        positions = (seq_lens - query_lens)[token_row] + torch.arange(tokens) - starts[:-1][token_row]

        token_theta = theta[token_row]  # [T, d/2]
        token_window = window[token_row].to(torch.float64)
        far_position = token_window + (positions - token_window) * leak[token_row]
        query_scale = log_n_factor(positions, tables.log_n_length[:rows][token_row]) * tables.query_factor[:rows][token_row]

        decode = (query_lens == 1).nonzero().flatten()
        prefill = [
            PrefillRow(slice(int(starts[r]), int(starts[r + 1])), int(seq_lens[r] - query_lens[r]), int(seq_lens[r]),
                       int(r), int(window[r]), float(leak[r]), theta[r])
            for r in (query_lens > 1).nonzero().flatten().tolist()
        ]

        decode_seq = seq_lens[decode]
        longest = int(decode_seq.max()) if decode.numel() else 0
        key_position = torch.arange(longest, dtype=torch.float64)
        decode_leak, decode_theta, decode_window = leak[decode], theta[decode], window[decode]
        far_keys = None
        if bool((decode_leak != 0).any()):
            far_keys = cos_sin(key_position[None, :, None] * (decode_leak[:, None] * decode_theta)[:, None, :], self.dtype)
        band = min(int(decode_window.max()) if decode.numel() else 0, longest)
        band_start = (decode_seq - band).clamp(min=0)
        band_keys = None
        if band > 0:
            band_position = band_start[:, None] + torch.arange(band)  # [Rd, W]
            band_keys = cos_sin(band_position[..., None].double() * decode_theta[:, None, :], self.dtype)

        return RopeExtendMetadata(
            num_actual_tokens=tokens,
            slot_mapping=common.slot_mapping[:tokens],
            block_table=common.block_table_tensor,
            query_scale=query_scale.to(self.dtype),
            near_query=cos_sin(positions[:, None].double() * token_theta, self.dtype),
            far_query=cos_sin(far_position[:, None] * token_theta, self.dtype),
            prefill=prefill,
            decode_rows=decode,
            decode_tokens=starts[:-1][decode],
            decode_seq_lens=decode_seq,
            decode_window=decode_window,
            decode_far_keys=far_keys,
            decode_band_start=band_start,
            decode_band_keys=band_keys,
        )


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

    # ---- cache ------------------------------------------------------------------------
    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        """Unrotated keys and values into their slots: kv_cache ``[blocks, kv_heads, block, 2d]``."""
        block_size = kv_cache.shape[2]
        slots = slot_mapping.long()
        kv_cache[slots // block_size, :, slots % block_size] = torch.cat((key, value), dim=-1)

    def gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[..., length, kv_heads, d]`` of the blocks ``block_ids [..., nb]``."""
        blocks = kv_cache[block_ids]  # [..., nb, kv, bs, 2d]
        tokens = blocks.transpose(-3, -2).flatten(-4, -3)[..., :length, :, :]  # [..., nb*bs, kv, 2d]
        return tokens[..., : self.head_size], tokens[..., self.head_size:]

    # ---- forward ----------------------------------------------------------------------
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
        query = query * meta.query_scale[:, None, None]
        near_query = rotate_by(query, meta.near_query[0][:, None], meta.near_query[1][:, None])
        far_query = rotate_by(query, meta.far_query[0][:, None], meta.far_query[1][:, None])
        if meta.decode_rows.numel():
            output[meta.decode_tokens] = self.decode(near_query, far_query, kv_cache, meta)
        for row in meta.prefill:
            output[row.tokens] = self.prefill(near_query[row.tokens], far_query[row.tokens], kv_cache, meta, row)
        return output

    def decode(self, near_query: torch.Tensor, far_query: torch.Tensor, kv_cache: torch.Tensor,
               meta: RopeExtendMetadata) -> torch.Tensor:
        """All decode rows at once: ``[Rd, heads, d]``."""
        rows, seq_lens = meta.decode_rows, meta.decode_seq_lens
        longest = int(seq_lens.max())
        block_size = kv_cache.shape[2]
        block_ids = meta.block_table[rows, : -(-longest // block_size)]
        keys, values = self.gather(kv_cache, block_ids, longest)  # [Rd, S, kv, d]
        if meta.decode_far_keys is not None:
            keys_far = rotate_by(keys, meta.decode_far_keys[0][:, :, None], meta.decode_far_keys[1][:, :, None])
        else:
            keys_far = keys  # ReRoPE: old keys are read raw
        q_far = far_query[meta.decode_tokens].view(-1, self.num_kv_heads, self.group, self.head_size)
        scores = torch.einsum("rkgd,rskd->rkgs", q_far, keys_far)  # [Rd, kv, g, S]

        position = torch.arange(longest)
        query_position = seq_lens - 1
        window = meta.decode_window
        far = position[None, :] <= (query_position - window)[:, None]  # r >= w
        valid = position[None, :] < seq_lens[:, None]
        if meta.decode_band_keys is not None:
            band = meta.decode_band_keys[0].shape[1]
            band_position = meta.decode_band_start[:, None] + torch.arange(band)  # [Rd, W]
            band_index = band_position.clamp(max=longest - 1)
            band_keys = torch.gather(keys, 1, band_index[:, :, None, None].expand(-1, -1, self.num_kv_heads, self.head_size))
            band_keys = rotate_by(band_keys, meta.decode_band_keys[0][:, :, None], meta.decode_band_keys[1][:, :, None])
            q_near = near_query[meta.decode_tokens].view(-1, self.num_kv_heads, self.group, self.head_size)
            band_scores = torch.einsum("rkgd,rwkd->rkgw", q_near, band_keys)
            in_band = (band_position < seq_lens[:, None]) & ((query_position[:, None] - band_position) < window[:, None])
            # near keys take their band score; far keys keep the score against the far rule
            target = torch.where(in_band, band_index, longest)  # out-of-band entries go to a spare column
            scores = torch.cat((scores, scores.new_zeros(scores.shape[:-1] + (1,))), dim=-1)
            scores.scatter_(-1, target[:, None, None, :].expand_as(band_scores), band_scores)
            scores = scores[..., :longest]
            keep = valid & (far | (position[None, :] >= meta.decode_band_start[:, None]))
        else:
            keep = valid & far
        scores = (scores * self.scale).masked_fill(~keep[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.einsum("rkgs,rskd->rkgd", weights, values)
        return out.reshape(-1, self.num_heads, self.head_size)

    def prefill(self, near_query: torch.Tensor, far_query: torch.Tensor, kv_cache: torch.Tensor,
                meta: RopeExtendMetadata, row: PrefillRow) -> torch.Tensor:
        """One request's chunk of ``L`` queries at positions ``context .. seq_len-1``: ``[L, heads, d]``."""
        chunk, context, seq_len, window = seq_len_of(row), row.context, row.seq_len, row.window
        block_size = kv_cache.shape[2]
        keys, values = self.gather(kv_cache, meta.block_table[row.row, : -(-seq_len // block_size)], seq_len)
        dtype = near_query.dtype
        outputs, lses = [], []

        # far part: queries m >= w see keys n <= m - w
        first_far = max(0, window - context)  # first query (in the chunk) that has far keys
        if first_far < chunk:
            if row.leak != 0:
                far_cos, far_sin = cos_sin(torch.arange(seq_len, dtype=torch.float64)[:, None] * (row.leak * row.theta), dtype)
                far_keys = rotate_by(keys, far_cos[:, None], far_sin[:, None])
            else:
                far_keys = keys
            q = heads_first(far_query[first_far:])[None]
            parts_out, parts_lse = [], []
            newest = context + first_far - window  # first key of the causal (triangle) part
            k_tri = heads_first(far_keys[newest: newest + chunk - first_far], self.group)[None]
            v_tri = heads_first(values[newest: newest + chunk - first_far], self.group)[None]
            out, lse = flash_attention(q, k_tri, v_tri, self.scale, causal=True)
            parts_out.append(out), parts_lse.append(lse)
            if newest > 0:  # keys older than every query's window: all visible
                out, lse = flash_attention(q, heads_first(far_keys[:newest], self.group)[None],
                                           heads_first(values[:newest], self.group)[None], self.scale)
                parts_out.append(out), parts_lse.append(lse)
            far_out = merge_partials(parts_out, parts_lse)[0]  # [H, L - first_far, d]
            far_lse = torch.logsumexp(torch.stack(parts_lse), dim=0)[0]
        # near part: keys with 0 <= m - n < w, in query tiles against their key band
        if window > 0:
            near_out, near_lse = self.near_band(near_query, keys, values, row, dtype)
            if first_far < chunk:
                merged_far = merge_partials([near_out[:, first_far:], far_out], [near_lse[:, first_far:], far_lse])
                near_out = torch.cat((near_out[:, :first_far], merged_far), dim=1)
            result = near_out
        else:
            result = far_out
        return result.transpose(0, 1)

    def near_band(self, near_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: PrefillRow,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding-window attention (plain RoPE inside the window) of a chunk, tile by tile in
        one batched call: ``[H, L, d]`` and its log-sum-exp ``[H, L]``."""
        chunk, context, window = seq_len_of(row), row.context, row.window
        tile = min(PREFILL_TILE, chunk)
        tiles = -(-chunk // tile)
        span = tile + window - 1
        query_index = torch.arange(tiles * tile).view(tiles, tile)
        key_position = context + torch.arange(tiles)[:, None] * tile - window + 1 + torch.arange(span)  # [tiles, span]
        query_position = context + query_index
        distance = query_position[:, :, None] - key_position[:, None, :]
        visible = (distance >= 0) & (distance < window) & (key_position[:, None, :] >= 0)
        visible &= (query_index < chunk)[:, :, None]
        visible[:, :, 0] |= ~visible.any(-1)  # keep padded rows finite; they are dropped below
        key_index = key_position.clamp(0, row.seq_len - 1)
        angle_cos, angle_sin = cos_sin(key_index.double()[..., None] * row.theta, dtype)
        band_keys = rotate_by(keys[key_index], angle_cos[:, :, None], angle_sin[:, :, None])  # [tiles, span, kv, d]
        queries = torch.nn.functional.pad(near_query, (0, 0, 0, 0, 0, tiles * tile - chunk)).view(tiles, tile, -1, self.head_size)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))[:, None]
        out, lse = flash_attention(heads_first(queries), heads_first(band_keys, self.group),
                                   heads_first(values[key_index], self.group), self.scale, mask=mask)
        out = out.transpose(0, 1).flatten(1, 2)[:, :chunk]  # [H, L, d]
        lse = lse.transpose(0, 1).flatten(1, 2)[:, :chunk]
        return out, lse


def seq_len_of(row: PrefillRow) -> int:
    return row.tokens.stop - row.tokens.start


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
