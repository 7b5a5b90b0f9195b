"""Compiles the Triton kernels (rope_plugins/ops/gpu.py) for a GPU on a machine without one.

The interpreter accepts code that a real compile refuses (a variable whose shape differs
between the branches of an ``if``, a non-constexpr tile size, a ``tl.dot`` under 16 rows), so
the tests also compile every kernel exactly as the wrappers launch it, through Triton's own
front end, optimiser and NVIDIA's ``ptxas`` (shipped with Triton): launches are captured on CPU
tensors instead of run. Run without ``TRITON_INTERPRET`` (the kernels must be JIT functions)::

    .venv/bin/python -m tests.ops.compile_kernels [sm_90 sm_80 ...]

It prints one line per compiled kernel (its name, dtype, target, shared memory, PTX size) and
exits 0; a kernel the compiler refuses raises.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float64: "*fp64",
                 torch.int32: "*i32", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


# (model dtype, fp8 cache format or None for a cache in the model's dtype)
CONFIGURATIONS = ((torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
                  (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2))
FP8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a wrapper made it: the kernel and its arguments by name."""

    kernel: triton.runtime.JITFunction
    arguments: dict
    options: dict  # the launch's own compile options (num_warps)

    def signature(self) -> tuple[dict, dict]:
        """Triton's types of the arguments, and the constexprs' values."""
        signature, constexprs = {}, {}
        for param in self.kernel.params:
            value = self.arguments[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                signature[param.name] = "fp32"
        return signature, constexprs

    def compile(self, target: GPUTarget):
        signature, constexprs = self.signature()
        return triton.compile(ASTSource(self.kernel, signature, constexprs), target=target, options=self.options)


class Recorder:
    """Stands in for a kernel: ``kernel[grid](...)`` records the launch instead of running it."""

    def __init__(self, kernel, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = [param.name for param in self.kernel.params]
            options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
            self.launches.append(Launch(self.kernel, {**dict(zip(names, args)), **kwargs}, options))

        return launch


def captured_launches(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> list[Launch]:
    """Every kernel launch of one step (prefill and decode rows of every method, GQA 4:1, head
    size 128, bfloat16's grid) in ``dtype``, on a cache of ``cache_dtype`` (None: ``dtype``; an
    fp8 format, with scales: the kernels' fp8 paths)."""
    from rope_plugins.attention.planner import kernel_plan
    from rope_plugins.ops import gpu
    from rope_plugins.rules.settings import ExtensionSettings
    from rope_plugins.testing.paged_steps import paged_step

    rows = [(ExtensionSettings(method="leaky_rerope", window=20, leaky_k=4.0, log_n=True, train_length=64), 30, 40),
            (ExtensionSettings(method="self_extend", window=12, group=4, train_length=64), 100, 1)]
    step = paged_step(rows, seed=0, head=128, kv=2, queries_per_kv=4, dtype=dtype)
    plan = kernel_plan(step.tables, query_start_cpu=step.starts, query_start=step.starts.to(torch.int32),
                       seq_lens=step.seq_lens.to(torch.int32), max_seq_len=int(step.seq_lens.max()),
                       block_table=step.block_table.to(torch.int32), slot_mapping=step.slots)
    cache = step.cache if cache_dtype is None else step.cache.to(cache_dtype)
    scales = {} if cache_dtype is None else dict(key_scale=0.5, value_scale=2.0)
    launches: list[Launch] = []
    kernels = ("write_cache_kernel", "prefill_kernel", "decode_split_kernel", "decode_reduce_kernel")
    originals = {name: getattr(gpu, name) for name in kernels}
    try:
        for name, kernel in originals.items():
            setattr(gpu, name, Recorder(kernel, launches))
        gpu.write_cache(step.key, step.value, cache, step.slots, **scales)
        gpu.prefill(step.query, cache, plan, torch.empty_like(step.query), scale=0.1, **scales)
        gpu.decode(step.query, cache, plan, torch.empty_like(step.query), scale=0.1, **scales)
    finally:
        for name, kernel in originals.items():
            setattr(gpu, name, kernel)
    return launches


def compiled_lines(dtype: torch.dtype, cache_dtype: torch.dtype | None, capability: int) -> list[str]:
    """One configuration's kernels compiled for ``sm_<capability>``: a line for each."""
    name = str(dtype).removeprefix("torch.") + (f"/{FP8_NAMES[cache_dtype]}" if cache_dtype else "")
    lines = []
    for launch in captured_launches(dtype, cache_dtype):
        if cache_dtype and launch.kernel.__name__ == "decode_reduce_kernel":  # the reduce never reads the cache
            continue
        compiled = launch.compile(GPUTarget("cuda", capability, 32))
        ptx = compiled.asm["ptx"]
        lines.append(f"{launch.kernel.__name__} {name} sm_{capability}: shared {compiled.metadata.shared} B, "
                     f"PTX {len(ptx)} chars, {ptx.count('div.full.f32')} approximate divisions")
    return lines


def main(argv: list[str]) -> int:
    """Each configuration on each target (fp8 needs sm_89 or later: fp8e4nv), compiled on every
    core: a compile is one thread's work, minutes for them all on a fresh machine."""
    import concurrent.futures
    import multiprocessing

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    capabilities = [int(name.removeprefix("sm_")) for name in argv] or [90]
    jobs = [(dtype, cache_dtype, capability) for dtype, cache_dtype in CONFIGURATIONS
            for capability in capabilities if cache_dtype is None or capability >= 89]
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), len(os.sched_getaffinity(0))),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for lines in pool.map(compiled_lines, *zip(*jobs)):
            print("\n".join(lines), flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
