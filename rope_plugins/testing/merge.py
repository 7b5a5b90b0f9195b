"""Exact softmax attention over disjoint key sets, from each part's output and log-sum-exp."""

from __future__ import annotations

import torch


def merge_partials(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge parts with outputs ``[..., L, d]`` and log-sum-exps ``[..., L]`` (float32) into
    the attention over the union of their keys, and its log-sum-exp.

    A query that sees no key in any part (every log-sum-exp ``-inf``, e.g. a tile's padding)
    gets a zero output and ``-inf``, not the NaN of ``-inf - -inf``.
    """
    lse = torch.stack(lses)
    merged_lse = torch.logsumexp(lse, dim=0)
    if len(outputs) == 1:
        return outputs[0], merged_lse
    top = lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # both -inf: weights exp(-inf) = 0
    weights = torch.exp(lse - top).unsqueeze(-1)  # [parts, ..., L, 1]
    total = weights.sum(0)
    merged = (torch.stack([o.float() for o in outputs]) * weights).sum(0) / torch.where(total > 0, total, 1.0)
    return merged.to(outputs[0].dtype), merged_lse
