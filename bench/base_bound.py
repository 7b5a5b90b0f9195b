"""The lower bound of the RoPE base for a training length (seed 002), and its command line:
``python bench/base_bound.py --length 8192 --head-dim 128`` (``make base-bound`` for the seed's row).

``b*(L) = inf { b : f_b(m) = sum_i cos(m b^(-2i/d)) >= 0 for m = 0 .. L-1 }``

The seed searched a grid of bases with JAX on a GPU. Two things make an exact search cheap
on a CPU here:

1. ``f_b(m)`` for all ``m < L`` is one small matrix product. Write ``m = s + j`` with ``s`` a
   block start and ``j < B``; then ``cos((s+j)t) = cos(st)cos(jt) - sin(st)sin(jt)``, so
   ``f_b[s, j] = [cos(sθ), -sin(sθ)] @ [cos(jθ); sin(jθ)]``: a float64 GEMM of
   ``(L/B) x d`` by ``d x B`` instead of ``L x d/2`` cosines.
2. A failing base certifies its neighbours: ``|d f_b(m) / d b| <= m sum_i e_i b^(-e_i-1)``
   (``e_i = 2i/d``, non-increasing in b), so if ``f_b(m) = -c < 0`` every base in
   ``[b, b + c / K)`` fails too. Walking up from ``b = 1`` by the largest certified step
   visits every base that could be valid, without a grid that might step over a narrow
   valid interval. Steps shrink near ``b*``; below a relative ``resolution`` the walk steps
   by that resolution instead (the only uncertified part, stated in the result).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

# First positive zero of the cosine integral Ci(x): the asymptotic bound is b ~ L / x0.
EULER_GAMMA = 0.5772156649015329


def cosine_integral(x: float, terms: int = 40) -> float:
    """Ci(x) = gamma + ln x + sum_k (-x^2)^k / (2k (2k)!), for 0 < x <~ 4."""
    total, term = 0.0, 1.0
    for k in range(1, terms):
        term *= -x * x / ((2 * k - 1) * (2 * k))  # (-x^2)^k / (2k)!
        total += term / (2 * k)
    return EULER_GAMMA + math.log(x) + total


def cosine_integral_first_zero() -> float:
    """x0 = 0.6165...: bisection of Ci on [0.5, 0.7], where it changes sign once."""
    low, high = 0.5, 0.7
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cosine_integral(mid) < 0 else (low, mid)
    return (low + high) / 2


CI_FIRST_ZERO = cosine_integral_first_zero()


def asymptotic_base_bound(length: int) -> float:
    """The d -> infinity estimate ``b* ~ L / x0``, ``x0`` the first zero of Ci."""
    return length / CI_FIRST_ZERO


def rotary_exponents(head_dim: int, rotary_fraction: float = 1.0) -> tuple[torch.Tensor, int]:
    """Exponents ``e_i`` with ``theta_i = b^(-e_i)`` for the rotated pairs, and the number of
    pairs left unrotated (each adds cos(0) = 1 to the sum), GPT-NeoX's partial rotation."""
    rotary_dim = int(round(head_dim * rotary_fraction))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_fraction {rotary_fraction} gives rotary dim {rotary_dim}")
    pair = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return 2.0 * pair / rotary_dim, (head_dim - rotary_dim) // 2


def cosine_sums(base: float, length: int, exponents: torch.Tensor, unrotated: int = 0,
                block: int = 1024, start: int = 0) -> torch.Tensor:
    """``f_b(m)`` for ``m = start .. start+length-1`` (rounded up to whole blocks), float64."""
    theta = base ** (-exponents)  # [pairs]
    block_starts = torch.arange(start, start + length, block, dtype=torch.float64)
    offsets = torch.arange(block, dtype=torch.float64)
    start_angle = block_starts[:, None] * theta  # [blocks, pairs]
    offset_angle = offsets[:, None] * theta  # [block, pairs]
    lhs = torch.cat((start_angle.cos(), -start_angle.sin()), dim=1)
    rhs = torch.cat((offset_angle.cos(), offset_angle.sin()), dim=1)
    return (lhs @ rhs.T).reshape(-1) + unrotated


@dataclass(frozen=True)
class Violation:
    position: int  # m with f_b(m) < 0
    value: float  # f_b(m)
    certified_step: float  # every base in [b, b + step) also fails at m


def first_violations(base: float, length: int, exponents: torch.Tensor, unrotated: int,
                     hint: int = 0, chunk: int = 1 << 16, hint_chunk: int = 1 << 12) -> Violation | None:
    """A failing position of ``base`` with the largest certified step in the first failing
    chunk of positions, or None if ``f_b(m) >= 0`` for all ``m < length``.

    Failures persist as the base grows, so the chunk around ``hint`` (the last failing
    position) is tried first; only if it passes are all positions scanned.
    """
    # d f / d b at position m is bounded by m * slope_per_position for every base >= b.
    slope_per_position = float((exponents * base ** (-exponents - 1)).sum())
    hint_start = min(max(hint - hint_chunk // 2, 0), max(length - hint_chunk, 0))
    spans = [(hint_start, min(hint_chunk, length))]
    spans += [(start, min(chunk, length - start)) for start in range(0, length, chunk)]
    for start, size in spans:
        # block ~ sqrt(size) balances the trig of the two factors against the product
        block = 1 << max(4, (size.bit_length() + 1) // 2)
        sums = cosine_sums(base, size, exponents, unrotated, block=block, start=start)
        positions = torch.arange(start, start + sums.numel(), dtype=torch.float64)
        failing = (sums < 0) & (positions < length)
        if failing.any():
            steps = torch.where(failing, -sums / (positions.clamp(min=1) * slope_per_position), 0.0)
            best = int(steps.argmax())
            return Violation(start + best, float(sums[best]), float(steps[best]))
    return None


@dataclass(frozen=True)
class BaseBound:
    length: int
    head_dim: int
    rotary_fraction: float
    base: float  # b*: the smallest base found with f_b(m) >= 0 for all m < L
    asymptotic: float  # L / x0
    evaluations: int
    uncertified_steps: int  # steps of `resolution` taken where no certificate was larger


def base_bound(length: int, head_dim: int = 128, rotary_fraction: float = 1.0,
               resolution: float = 1e-6, start: float = 1.0 + 1e-9) -> BaseBound:
    """The smallest RoPE base with ``sum_i cos(m theta_i) >= 0`` for every ``m < length``.

    Walks up from ``start`` by certified steps (see the module doc); exact up to the relative
    ``resolution`` where certificates get smaller than that.
    """
    exponents, unrotated = rotary_exponents(head_dim, rotary_fraction)
    base, evaluations, uncertified, hint = start, 0, 0, 0
    while True:
        violation = first_violations(base, length, exponents, unrotated, hint)
        evaluations += 1
        if violation is None:
            return BaseBound(length, head_dim, rotary_fraction, base,
                             asymptotic_base_bound(length), evaluations, uncertified)
        step, hint = violation.certified_step, violation.position
        if step < resolution * base:
            step, uncertified = resolution * base, uncertified + 1
        base += step


def base_bound_row(lengths: list[int], head_dim: int = 128, rotary_fraction: float = 1.0,
                   resolution: float = 1e-6) -> list[BaseBound]:
    """``base_bound`` for several lengths, each walk starting at the previous length's b*:
    a base that fails for L fails for every longer length, so nothing below is skipped."""
    results, start = [], 1.0 + 1e-9
    for length in sorted(lengths):
        result = base_bound(length, head_dim, rotary_fraction, resolution, start)
        results.append(result)
        start = result.base
    return results


def _describe(result: BaseBound) -> str:
    if result.evaluations == 1 and result.base < 1.5:
        return (f"L = {result.length:>8}: any base > 1 works (rotary fraction {result.rotary_fraction}: "
                "the unrotated pairs keep the sum non-negative)")
    return (f"L = {result.length:>8}: b* = {result.base:.4g}   asymptotic L/x0 = {result.asymptotic:.4g}"
            f"   ({result.evaluations} bases checked)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/base_bound.py", description="the RoPE base lower bound of seed 002")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--length", type=int, help="training length L")
    what.add_argument("--row", type=int, nargs="+", default=[1024 * 2**i for i in range(11)],
                      help="several lengths (default: the seed's row, 1k .. 1M)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rotary-fraction", type=float, default=1.0,
                        help="share of the head dims that are rotated (GPT-NeoX partial rotation)")
    parser.add_argument("--resolution", type=float, default=1e-6,
                        help="smallest relative step where no larger step is certified")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.length:
        results = [base_bound(args.length, args.head_dim, args.rotary_fraction, args.resolution)]
    else:
        results = base_bound_row(args.row, args.head_dim, args.rotary_fraction, args.resolution)
    if args.json:
        print(json.dumps([vars(result) for result in results], indent=2))
        return 0
    print(f"smallest RoPE base with sum_i cos(m b^(-2i/d)) >= 0 for all m < L, d = {args.head_dim}")
    for result in results:
        print(_describe(result))
    print(f"({time.perf_counter() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
