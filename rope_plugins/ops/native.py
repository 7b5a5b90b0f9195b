"""The C++ kernels (``csrc/``: decode, one-pass prefill, the cache write; one module): built on first use with
PyTorch's extension builder and cached (``scripts/install.sh`` builds them once ahead of
time), and typed wrappers called by keyword.

Without a C++ compiler the kernels are unavailable and attention takes the plain PyTorch path
(rope_plugins/ops/cpu.py), which computes the same thing. With a compiler, a failed build is an
error (:class:`KernelBuildError`): the install stops and the engine does not start, rather than
serving on the slow path unnoticed.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The longest to compile first (the bindings carry pybind11 and the extension header), so that the
# build's parallel jobs end together.
SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp", "write_cache.cpp",
                         "cache_layout.cpp")]
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
        logger.warning("rope_plugins: no C++ compiler (%s); attention takes the plain PyTorch path",
                       os.environ.get("CXX", "c++"))
        return None
    from torch.utils.cpp_extension import load

    name = f"rope_plugins_kernels_{MARCH.replace('-', '_')}"
    directory = build_directory(name)
    try:
        with build_lock(directory), builder_on_path():
            library = directory / f"{name}.so"
            stale = not library.exists() or library.stat().st_mtime < max(s.stat().st_mtime for s in SOURCES)
            if stale:
                logger.info("rope_plugins: compiling the C++ kernels into %s (once per install; a few minutes)",
                            directory)
            began = time.perf_counter()
            module = load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                          build_directory=str(directory), verbose=False)
            if stale:
                logger.info("rope_plugins: C++ kernels compiled in %.0f s", time.perf_counter() - began)
    except Exception as error:
        raise KernelBuildError(f"the C++ decode kernel failed to build with {compiler()}: {error}") from error
    return module


@contextlib.contextmanager
def builder_on_path():
    """PATH with this interpreter's own folder first while the kernels load, so that every
    process (the install, the engine, a test) runs the same ``ninja``: the one vLLM installs
    beside Python. ninja records each build's commands in its own log format; a second ninja
    of another version (a system one, on an engine's plain PATH) finds that log foreign and
    compiles everything again."""
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), *([previous] if previous else [])])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def build_directory(name: str) -> Path:
    """Where the kernels are built and cached: under PyTorch's extension root (``TORCH_EXTENSIONS_DIR``,
    else ~/.cache/torch_extensions), one folder per Python, PyTorch, target and checkout (the build
    names its sources by path: two checkouts sharing a folder would rebuild it for each other)."""
    from torch.utils.cpp_extension import get_default_build_root

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    checkout = hashlib.sha256(str(SOURCES[0].parent).encode()).hexdigest()[:8]
    directory = Path(root) / f"{python}_torch{torch.__version__}" / f"{name}_{checkout}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def build_lock(directory: Path):
    """One builder at a time, by an OS lock the kernel drops when its process dies.

    PyTorch's own lock is a file that a killed build (Ctrl-C, an install stopped by a timeout)
    leaves behind, and every later load then waits for it forever. Under this lock no other
    builder is running, so a ``lock`` file found here is such a leftover and is removed.
    """
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        leftover = directory / "lock"
        if leftover.exists():
            logger.warning("rope_plugins: removing %s, left by a kernel build that was stopped", leftover)
            leftover.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def packed(inputs, **fields):
    """``inputs`` (a struct of csrc/attention_inputs.h) with ``fields`` set, tensors made contiguous
    (a name the struct does not have is an error)."""
    for name, value in fields.items():
        setattr(inputs, name, value.contiguous() if isinstance(value, torch.Tensor) else value)
    return inputs


def decode_inputs(*, query_scale: torch.Tensor, query_cos: torch.Tensor, query_sin: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, window: torch.Tensor, band_start: torch.Tensor,
                  near_cos: torch.Tensor, near_sin: torch.Tensor, far_step_cos: torch.Tensor,
                  far_step_sin: torch.Tensor, far_offset_cos: torch.Tensor, far_offset_sin: torch.Tensor,
                  far_table: torch.Tensor):
    """The decode rows of one step as the C++ decode reads them (``DecodeInputs``), packed once for every layer.

    Cosines and sines of: query_cos / sin ``[R, 2, d/2]``, the near angle ``m θ`` and the far angle
    ``(w + (m - w) ρ) θ``; near_cos / sin ``[R, W, d/2]``, the band keys' from ``band_start`` (empty
    without a band); the far keys' angles ``n ω`` (one rule per distinct setting) as far_step_cos /
    sin ``[U, S / step, d/2]`` (``n = s * step``) and far_offset_cos / sin ``[U, step, d/2]``
    (``n = o``; the step divides the kernel's ``DECODE_CHUNK``). query_scale ``[R]``; block_table
    ``[R, nb]``; seq_lens, window, band_start, far_table ``[R]`` (far_table -1: the row reads old
    keys raw).
    """
    index = lambda tensor: tensor.to(torch.int64)  # noqa: E731
    return packed(kernels().DecodeInputs(), query_scale=query_scale.float(), query_cos=query_cos,
                  query_sin=query_sin, block_table=index(block_table), seq_lens=index(seq_lens), window=index(window),
                  band_start=index(band_start), near_cos=near_cos, near_sin=near_sin, far_step_cos=far_step_cos,
                  far_step_sin=far_step_sin, far_offset_cos=far_offset_cos, far_offset_sin=far_offset_sin,
                  far_table=index(far_table))


def decode_attention(inputs, *, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                     rounded_once: bool = False) -> torch.Tensor:
    """Single-pass decode of the rows of ``inputs`` (:func:`decode_inputs`) over the paged cache,
    float32: query ``[R, H, d]`` unrotated and unscaled, kv_cache ``[blocks, kv, bs, 2d]``. Returns ``[R, H, d]``.
    A bfloat16 cache's raw keys (ReRoPE's old keys) meet the far queries as two bfloat16 parts by
    vdpbf16ps, or rounded once to bfloat16 where ``rounded_once``."""
    return kernels().decode_attention(inputs, query, kv_cache, scale, rounded_once)


def write_cache(*, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                key_scale: float = 1.0, value_scale: float = 1.0) -> None:
    """Keys and values ``[T, kv, d]`` (unrotated) into ``kv_cache`` ``[blocks, kv, bs, 2d]`` at
    ``slots`` ``[T]`` (``block * bs + offset``; negative slots are padding and skipped); into an
    fp8 cache divided by ``key_scale`` and ``value_scale`` and rounded as ``cpu.quantized`` does."""
    kernels().write_cache(key, value, kv_cache, slots, key_scale, value_scale)


def cache_key_tiles(*, kv_cache: torch.Tensor, block_ids: torch.Tensor, first: int, count: int,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, origin: int, tiles: int) -> torch.Tensor:
    """Keys at positions ``first .. first + count - 1`` of the sequence in blocks ``block_ids``,
    turned by the angles of ``cos`` and ``sin`` (``[count, d/2]``; None: raw), as tiles ``[kv,
    tiles, d, KEY_TILE]``: key ``n`` at column ``(n - origin) % KEY_TILE`` of tile ``(n - origin) //
    KEY_TILE``, zero elsewhere. float32."""
    empty = kv_cache.new_empty(0)
    cos, sin = (cos, sin) if cos is not None else (empty, empty)
    return kernels().cache_key_tiles(kv_cache, block_ids, first, count, cos, sin, origin, tiles)


def cache_values(*, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The values of positions ``0 .. seq_len - 1`` of the sequence in blocks ``block_ids``: ``[kv, seq_len, d]``."""
    return kernels().cache_values(kv_cache, block_ids, seq_len)


@functools.cache
def matrix_tiles_ready() -> bool:
    """Whether the prefill can take AMX tiles (``csrc/matrix_tiles.h``): the kernels were built for
    a CPU with AMX and the OS granted this process their state. False on every other CPU."""
    module = kernels()
    return module is not None and module.matrix_tiles_ready()


def prefill_inputs(*, query_scale: torch.Tensor, near_cos: torch.Tensor, near_sin: torch.Tensor,
                   far_cos: torch.Tensor, far_sin: torch.Tensor, near_from: torch.Tensor, context: int, banded: bool,
                   near_origin: int, matrix_tiles: bool = False, rounded_once: bool = False):
    """One prefill row's chunk of ``L`` queries at ``context .. context + L - 1`` as the C++
    prefill reads it (``PrefillInputs``): query_scale ``[L]``, the cosines and sines of each
    query's near and far angle ``[L, d/2]``, each query's first near key ``near_from`` ``[L]``
    (``m - w + 1``), whether there are near keys at all (``banded``), and ``near_origin``, the
    first near key tile's position (a multiple of ``KEY_TILE`` at or before the first key any
    near query sees). ``matrix_tiles``: the scores and P.V on AMX tiles, each float32 operand as
    two bfloat16 parts (only where :func:`matrix_tiles_ready`), or rounded once to bfloat16 where
    ``rounded_once`` (stock vLLM's arithmetic)."""
    return packed(kernels().PrefillInputs(), query_scale=query_scale.float(), near_cos=near_cos, near_sin=near_sin,
                  far_cos=far_cos, far_sin=far_sin, near_from=near_from.to(torch.int64), context=context,
                  banded=banded, near_origin=near_origin, matrix_tiles=matrix_tiles, rounded_once=rounded_once)


def prefill_attention(inputs, *, query: torch.Tensor, near_keys: torch.Tensor, far_keys: torch.Tensor,
                      values: torch.Tensor, scale: float) -> torch.Tensor:
    """One-pass prefill of the row of ``inputs`` (:func:`prefill_inputs`), float32.

    query ``[L, H, d]`` unrotated and unscaled (the kernel scales each query by its factor and the
    softmax ``scale`` and turns it to its near and far angle as it reads it); near_keys ``[kv, tiles,
    d, KEY_TILE]``: keys at ``n θ`` from ``near_origin``; far_keys ``[kv, tiles, d, KEY_TILE]`` from
    position 0 at their far angle (raw under ReRoPE), both zero past the sequence's end
    (:func:`cache_key_tiles`); values ``[kv, seq_len, d]``. Returns ``[L, H, d]``.
    """
    return kernels().prefill_attention(inputs, query, near_keys, far_keys, values, scale)


if __name__ == "__main__":
    # scripts/install.sh: build it now; a failed build fails the install
    try:
        print("decode kernel:", "ready" if kernels() is not None else "unavailable (no C++ compiler)")
    except KernelBuildError as error:
        sys.exit(f"decode kernel: {error}")
