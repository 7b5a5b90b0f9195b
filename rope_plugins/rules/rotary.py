"""The rotary math of every method, as small pure functions.

Notation (DESIGN.md): head dim ``d``, pair index ``i = 0 .. d/2-1``, base ``b``,
``theta_i = b^(-2i/d)``, extension factor ``k``. Tables are float64; callers cast.

Frequency methods change ``theta`` and keep positions; relative-position methods
(ReRoPE, Leaky ReRoPE) keep ``theta`` and bend the relative position ``r = m - n``.
Which method uses which formula: :mod:`rope_plugins.rules.methods`.
"""

from __future__ import annotations

import math

import torch

# YaRN's NTK-by-parts ramp bounds (alpha, beta of the YaRN paper, in rotations over L_train).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE: ``theta_i = b^(-2i/d)``, shape ``[d/2]``."""
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    return base ** (-2.0 * pair / head_dim)


def pi_inv_freq(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """Position interpolation: every frequency divided by k."""
    return rope_inv_freq(head_dim, base) / factor


def ntk_old_inv_freq(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """NTK-aware scaling as first proposed: base b -> b*k, ``theta_i = (b k)^(-2i/d)``."""
    return rope_inv_freq(head_dim, base * factor)


def ntk_dynamic_exponent(head_dim: int) -> torch.Tensor:
    """Dynamic NTK (transformers' "dynamic" rope) at factor k has base ``b k^(d/(d-2))``, i.e.
    ``theta_i k^(-e_i)`` with ``e_i = 2i/(d-2)``: the highest frequency kept, the lowest divided
    by exactly k. Returns ``e``, ``[d/2]``."""
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    return 2.0 * pair / (head_dim - 2)


def dynamic_length(positions: torch.Tensor, train_length: int | torch.Tensor, step: int) -> torch.Tensor:
    """The sequence length ntk_dynamic sizes its factor to at each 0-based query position:
    the ``m + 1`` tokens seen, rounded up to ``L + j step`` past the training length ``L``;
    ``L`` within it (factor 1). int64, one per position."""
    past = (positions + 1 - train_length).clamp(min=0)
    return train_length + -(-past // step) * step


def ntk_fixed_inv_freq(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """NTK with the radix fix: ``theta_i = b^(-2i/d) k^(-2(i+1)/d)``."""
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    return rope_inv_freq(head_dim, base) * factor ** (-2.0 * (pair + 1) / head_dim)


def ntk_mixed_inv_freq(head_dim: int, base: float, factor: float, beta: float) -> torch.Tensor:
    """Mixed radix: ``theta_i = b^(-2i/d) exp(-a (i+1)^beta)`` with ``a (d/2)^beta = ln k``.

    beta = 1 gives ntk_fixed, beta = 0 gives pi.
    """
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    a = math.log(factor) / (head_dim / 2) ** beta
    return rope_inv_freq(head_dim, base) * torch.exp(-a * (pair + 1) ** beta)


def yarn_correction_dim(rotations: float, head_dim: int, base: float, train_length: int) -> float:
    """The (fractional) dimension index whose wavelength fits ``rotations`` turns in L_train."""
    return head_dim * math.log(train_length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(head_dim: int, base: float, factor: float, train_length: int, *, beta_fast: float = YARN_BETA_FAST,
                  beta_slow: float = YARN_BETA_SLOW, truncate: bool = True) -> torch.Tensor:
    """YaRN's NTK-by-parts: high frequencies kept, low ones interpolated by k, a linear ramp
    between the dimensions that turn ``beta_fast`` and ``beta_slow`` times in L_train."""
    low = yarn_correction_dim(beta_fast, head_dim, base, train_length)
    high = yarn_correction_dim(beta_slow, head_dim, base, train_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    interpolated_share = ((pair - low) / (high - low)).clamp(0.0, 1.0)
    extrapolated = rope_inv_freq(head_dim, base)
    return extrapolated * (1 - interpolated_share) + extrapolated / factor * interpolated_share


def llama3_inv_freq(head_dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_length: int) -> torch.Tensor:
    """Llama 3.1's table: wavelengths shorter than ``L / high_freq_factor`` kept, longer than
    ``L / low_freq_factor`` divided by the factor, a smooth blend in ``L / wavelength`` between."""
    theta = rope_inv_freq(head_dim, base)
    wavelength = 2 * math.pi / theta
    smooth = ((original_length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - smooth) * theta / factor + smooth * theta


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature: q and k are each scaled by ``0.1 mscale ln k + 1``, so logits by its square."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def log_n_scale(positions: torch.Tensor, train_length: int | torch.Tensor) -> torch.Tensor:
    """The log-n query factor ``max(1, log(n) / log(L_train))`` for the token at 0-based
    position ``m``, with ``n = m + 1`` tokens seen (as the reference implementation does).
    ``train_length`` may be one length or one per position."""
    seen = positions.to(torch.float64) + 1
    return (seen.log() / torch.as_tensor(train_length, dtype=torch.float64).log()).clamp(min=1.0)


def rotate(x: torch.Tensor, angle: torch.Tensor, neox_style: bool = True) -> torch.Tensor:
    """Rotate each pair of ``x[..., d]`` by ``angle[..., d/2]`` (broadcast).

    ``neox_style`` pairs dim ``i`` with ``i + d/2`` (Llama in transformers and vLLM);
    otherwise adjacent dims ``2i, 2i+1`` form a pair (GPT-J style).
    """
    return rotate_by(x, angle.cos().to(x.dtype), angle.sin().to(x.dtype), neox_style)


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox_style: bool = True) -> torch.Tensor:
    """:func:`rotate` with the angles' cosines and sines given (``[..., d/2]``, broadcast)."""
    if neox_style:
        first, second = x.chunk(2, dim=-1)
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if neox_style:
        return torch.cat((rotated_first, rotated_second), dim=-1)
    return torch.stack((rotated_first, rotated_second), dim=-1).flatten(-2)
