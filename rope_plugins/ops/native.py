"""The C++ kernels (``csrc/``: decode, one-pass prefill, the cache write; one module): built on first use with
PyTorch's extension builder and cached (``scripts/install.sh`` builds them once ahead of
time), and typed wrappers called by keyword.

Without a C++ compiler the kernels are unavailable and attention takes the PyTorch path,
which computes the same thing. With a compiler, a failed build is an error (:class:`KernelBuildError`):
the install stops and the engine does not start, rather than serving on the slow path unnoticed.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from rope_plugins.attention.planner import Rotation

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("decode_attention.cpp", "prefill_attention.cpp", "write_cache.cpp", "cache_layout.cpp",
                         "bindings.cpp")]
# Reassociation lets the compiler vectorise the dot products; inf/nan semantics are kept.
# ROPE_EXTEND_MARCH: the target CPU (images built for other machines set e.g. x86-64-v3).
MARCH_ENV = "ROPE_EXTEND_MARCH"
MARCH = os.environ.get(MARCH_ENV, "native")
# -fopenmp: ATen's parallel_for is an inline OpenMP region, so without it the kernel's
# chunks run one after another on one core (tests/attention/test_attention.py checks the build).
# -fno-math-errno lets `omp simd` loops call the vector exp (glibc's libmvec).
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """A compiler is here and the kernel did not build: a regression, not a missing tool."""


def compiler() -> str | None:
    """The C++ compiler PyTorch's extension builder would use, if this machine has it."""
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def kernels():
    """The compiled module of the C++ kernels (decode, prefill); None only when there is no compiler."""
    if compiler() is None:
        logger.warning("rope_plugins: no C++ compiler (%s); attention takes the PyTorch path", os.environ.get("CXX", "c++"))
        return None
    from torch.utils.cpp_extension import load

    try:
        return load(name=f"rope_plugins_kernels_{MARCH.replace('-', '_')}", sources=[str(s) for s in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS, verbose=False)
    except Exception as error:
        raise KernelBuildError(f"the C++ decode kernel failed to build with {compiler()}: {error}") from error


def decode_attention(*, query: torch.Tensor, query_scale: torch.Tensor, query_cos: torch.Tensor,
                     query_sin: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_lens: torch.Tensor,
                     window: torch.Tensor, band_start: torch.Tensor, near_cos: torch.Tensor, near_sin: torch.Tensor,
                     far_steps: Rotation, far_offsets: Rotation, far_table: torch.Tensor, step: int,
                     scale: float) -> torch.Tensor:
    """Single-pass decode of ``R`` rows over the paged cache, float32.

    query ``[R, H, d]`` unrotated and unscaled; query_scale ``[R]``; query_cos / sin ``[R, 2, d/2]``
    (the near angle ``m θ`` and the far angle ``(w + (m - w) ρ) θ``); kv_cache
    ``[blocks, kv, bs, 2d]``; block_ids ``[R, nb]``; seq_lens, window, band_start ``[R]`` int64;
    near_cos / sin ``[R, W, d/2]`` for the band keys from ``band_start`` (empty without a band);
    the far keys' angles ``n ω`` (one rule per distinct setting) as ``far_steps`` ``[U, S / step, d/2]``
    (``n = s * step``) and ``far_offsets`` ``[U, step, d/2]`` (``n = o``), with far_table ``[R]``
    (-1: the row reads old keys raw); ``step`` divides the kernel's 512-key chunk. Returns ``[R, H, d]``.
    """
    return kernels().decode_attention(query, query_scale, query_cos, query_sin, kv_cache, block_ids, seq_lens,
                                      window, band_start, near_cos, near_sin, far_steps.cos, far_steps.sin,
                                      far_offsets.cos, far_offsets.sin, far_table, step, scale)


def write_cache(*, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Keys and values ``[T, kv, d]`` (unrotated) into ``kv_cache`` ``[blocks, kv, bs, 2d]`` at
    ``slots`` ``[T]`` (``block * bs + offset``; negative slots are padding and skipped)."""
    kernels().write_cache(key, value, kv_cache, slots)


def cache_key_tiles(*, kv_cache: torch.Tensor, block_ids: torch.Tensor, first: int, count: int,
                    rotation: Rotation | None, origin: int, tiles: int) -> torch.Tensor:
    """Keys at positions ``first .. first + count - 1`` of the sequence in blocks ``block_ids``,
    turned by ``rotation`` (``[count, d/2]``; None: raw), as tiles ``[kv, tiles, d, 32]``: key
    ``n`` at column ``(n - origin) % 32`` of tile ``(n - origin) // 32``, zero elsewhere. float32."""
    empty = kv_cache.new_empty(0)
    cos, sin = (rotation.cos, rotation.sin) if rotation is not None else (empty, empty)
    return kernels().cache_key_tiles(kv_cache, block_ids, first, count, cos, sin, origin, tiles)


def cache_values(*, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The values of positions ``0 .. seq_len - 1`` of the sequence in blocks ``block_ids``: ``[kv, seq_len, d]``."""
    return kernels().cache_values(kv_cache, block_ids, seq_len)


def prefill_attention(*, query: torch.Tensor, query_scale: torch.Tensor, near: Rotation, far: Rotation,
                      near_keys_t: torch.Tensor, far_keys_t: torch.Tensor, values: torch.Tensor, context: int,
                      window: int, near_origin: int, scale: float) -> torch.Tensor:
    """One-pass prefill of one request's chunk of ``L`` queries at ``context .. context + L - 1``, float32.

    query ``[L, H, d]`` unrotated and unscaled (the kernel scales each by ``query_scale`` ``[L]``
    and the softmax ``scale``, and turns it by ``near`` and ``far``, ``[L, d/2]`` each, as it
    reads it); near_keys_t ``[kv, tiles, d, 32]``: keys at ``n θ`` in tiles of 32 from
    position ``near_origin`` (a multiple of 32 at or before the first key any near query sees);
    far_keys_t ``[kv, tiles, d, 32]`` from position 0 at their far angle (raw under ReRoPE), both
    zero past the sequence's end; values ``[kv, seq_len, d]``. Returns ``[L, H, d]``.
    """
    return kernels().prefill_attention(query, query_scale, near.cos, near.sin, far.cos, far.sin, near_keys_t,
                                       far_keys_t, values, context, window, near_origin, scale)


if __name__ == "__main__":
    # scripts/install.sh: build it now; a failed build fails the install
    try:
        print("decode kernel:", "ready" if kernels() is not None else "unavailable (no C++ compiler)")
    except KernelBuildError as error:
        sys.exit(f"decode kernel: {error}")
