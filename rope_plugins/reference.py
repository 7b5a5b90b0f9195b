"""The reference oracle: slow, plain, obviously right.

For every method it builds the full matrix of effective relative positions, rotates each key
explicitly by the angle its query sees it at, and runs a float64 causal softmax attention over
the whole sequence with GQA. Every fast path is tested against this.
"""

from __future__ import annotations

import math

import torch

from .rotary import effective_relative, inv_freq, query_scale, rotate
from .settings import ExtensionSettings


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    settings: ExtensionSettings,
    *,
    base: float,
    positions: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    neox_style: bool = True,
    query_rows_per_chunk: int = 64,
) -> torch.Tensor:
    """Causal attention of one sequence under ``settings``, keys and queries **unrotated**.

    query ``[seq, q_heads, d]``, key/value ``[seq, kv_heads, d]``, positions ``[seq]``
    (default ``0..seq-1``). The query at position m scores the key at n <= m as
    ``q_m^T R(-rel(m - n)) k_n`` with ``rel`` the method's effective relative position and
    ``R`` the rotation by the method's frequencies. Returns ``[seq, q_heads, d]``.
    """
    seq_len, q_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    if positions is None:
        positions = torch.arange(seq_len)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)

    theta = inv_freq(settings, head_dim, base)  # [d/2]
    scaled_query = query.double() * query_scale(settings, positions)[:, None, None]
    key64, value64 = key.double(), value.double()
    out = torch.empty(seq_len, q_heads, head_dim, dtype=torch.float64)

    for start in range(0, seq_len, query_rows_per_chunk):
        rows = slice(start, start + query_rows_per_chunk)
        distance = positions[rows, None] - positions[None, :]  # [rows, seq], m - n
        causal = distance >= 0
        relative = effective_relative(settings, distance.clamp(min=0))
        angle = -relative[..., None] * theta  # key n as query m sees it: R(-rel) k_n
        seen_key = rotate(key64[None], angle[:, :, None, :], neox_style)  # [rows, seq, kv, d]

        q = scaled_query[rows].view(-1, kv_heads, group, head_dim)  # [rows, kv, group, d]
        scores = torch.einsum("rkgd,rskd->rkgs", q, seen_key) * softmax_scale
        scores = scores.masked_fill(~causal[:, None, None, :], float("-inf"))
        weights = scores.softmax(dim=-1)
        mixed = torch.einsum("rkgs,skd->rkgd", weights, value64)
        out[rows] = mixed.reshape(-1, q_heads, head_dim)
    return out.to(query.dtype)


def plain_rope_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    base: float,
    positions: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    neox_style: bool = True,
) -> torch.Tensor:
    """Textbook RoPE attention (rotate q and k by their absolute positions, then softmax):
    an independent check of the oracle's ``none`` method."""
    seq_len, q_heads, head_dim = query.shape
    group = q_heads // key.shape[1]
    if positions is None:
        positions = torch.arange(seq_len)
    theta = base ** (-2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None, None] * theta  # [seq, 1, d/2]
    q = rotate(query.double(), angle, neox_style)
    k = rotate(key.double(), angle, neox_style).repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (softmax_scale or 1.0 / math.sqrt(head_dim))
    causal = positions[:, None] >= positions[None, :]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v).to(query.dtype)


class UnrotatedRotaryEmbedding(torch.nn.Module):
    """A transformers Llama rotary embedding that rotates nothing (cos 1, sin 0): put in place
    of ``model.model.rotary_emb``, q and k reach the attention function unrotated, so an
    attention registered with transformers can apply any method itself."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        shape = (*position_ids.shape, self.head_dim)
        return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)
