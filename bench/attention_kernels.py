"""The CPU attention kernels on the same inputs: vLLM's paged kernel (stock vLLM's), PyTorch's
fused flash attention (merged by log-sum-exp, as a PyTorch prefill would), and the plugin's
one-pass C++ prefill and decode with their input preparation, all keys far (the frequency
methods' shape) and with a 1024-token window (ReRoPE's).

    .venv/bin/python -m bench kernels

SmolLM2's heads (9 q / 3 kv, d64), causal chunks over their context as a prefill step sees
them; rotations are identities, so every kernel computes the same attention and the outputs
are compared. Interleaved repetitions, medians; writes bench/results/attention_kernels.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from bench import harness

RESULTS = harness.RESULTS
QUERY_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128
SCALE = HEAD_DIM ** -0.5
REROPE_WINDOW = 1024
CASES = [(0, 4096), (0, 8192), (8192, 8192), (24576, 8192)]  # (context, chunk)
DECODE_CASES = [(1, 8192), (1, 16384), (1, 32768), (8, 2048)]  # (rows, keys per row)
DECODE_CALLS = 20  # calls per timing (one call is milliseconds)


def vllm_isa(dtype: torch.dtype) -> str:
    """The ISA vLLM's CPU attention picks for ``dtype``. Its AMX kernels need the tile state the
    kernel grants a process only on request, which vLLM's worker makes at start and a bare call
    of its op does not: without it, an AMX machine's first tile instruction is illegal."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BLOCK, HEAD_DIM)
    if isa == "amx" and not torch.cpu._init_amx():
        raise RuntimeError("vLLM chose its AMX attention, but the kernel did not grant this process AMX tiles")
    return isa


def vllm_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_split: bool):
    """vLLM's kernel as stock vLLM calls it: key / value ``[R, S, kv, d]`` (every row ``S`` keys)
    written into its cache and the schedule made, then a function of no arguments that runs it on
    query ``[R * n, H, d]`` (each row's last ``n`` tokens, causal)."""
    from vllm import _custom_ops as ops
    rows, seq = key.shape[:2]
    isa = vllm_isa(query.dtype)
    per_row = -(-seq // BLOCK)
    key_cache, value_cache = torch.empty(rows * per_row, KV_HEADS, 2 * BLOCK, HEAD_DIM, dtype=key.dtype).chunk(2, dim=2)
    slots = torch.arange(rows * per_row * BLOCK).view(rows, -1)[:, :seq].flatten()
    ops.cpu_attn_reshape_and_cache(key.flatten(0, 1), value.flatten(0, 1), key_cache, value_cache, slots, isa)
    starts = torch.arange(rows + 1, dtype=torch.int32) * (query.shape[0] // rows)
    lengths = torch.full((rows,), seq, dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=QUERY_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=lengths,
        dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=kv_split)
    block_table = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    out = torch.empty_like(query)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=lengths, scale=SCALE, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=None)
        return out

    return run


def vllm_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: int):
    """vLLM's kernel on one chunk, its cache written and schedule made in every timed call."""
    return lambda: vllm_kernel(query, key[None], value[None], kv_split=False)()


def torch_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: int):
    """PyTorch's fused CPU flash attention (with its log-sum-exp), as a PyTorch prefill would call it."""
    from rope_plugins.testing.merge import merge_partials

    flash = partial(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, scale=SCALE)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [L, kv, d] to [1, H, L, d], each KV head for its queries
        return x.transpose(0, 1)[None].repeat_interleave(QUERY_HEADS // KV_HEADS, dim=1)

    def run() -> torch.Tensor:
        q = query.transpose(0, 1)[None]
        parts = [flash(q, heads_first(key[context:]), heads_first(value[context:]), 0.0, True)]
        if context:
            parts.append(flash(q, heads_first(key[:context]), heads_first(value[:context]), 0.0, False))
        return merge_partials(*zip(*parts))[0][0].transpose(0, 1)

    return run


def paged(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Rows of keys and values ``[R, S, kv, d]`` in the plugin's cache ``[blocks, kv, bs, 2d]``, blocks in order."""
    rows, seq = key.shape[:2]
    per_row = -(-seq // BLOCK)
    cache = torch.zeros(rows, per_row * BLOCK, KV_HEADS, 2 * HEAD_DIM, dtype=key.dtype)
    cache[:, :seq] = torch.cat((key, value), dim=-1)
    return cache.view(rows * per_row, BLOCK, KV_HEADS, 2 * HEAD_DIM).transpose(1, 2).contiguous()


def plugin_prefill(window: int, matrix_tiles: bool | None = None, rounded_once: bool = False):
    """The plugin's one-pass prefill as the attention calls it (rope_plugins.ops.cpu.prefill_kernel:
    keys and values read out of the paged cache, then the kernel), with identity rotations (so its
    answer is plain causal attention); the cache is written outside the timing. ``matrix_tiles``
    False keeps a 16-bit cache on the float32 micro-kernel where the CPU has AMX tiles;
    ``rounded_once``: attention_precision bfloat16 (the tiles' operands rounded once)."""
    from rope_plugins.attention.planner import PrefillRow, QueryPlan, Rotation
    from rope_plugins.ops import cpu

    def prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: int):
        chunk, seq, half = query.shape[0], key.shape[0], HEAD_DIM // 2
        cache = paged(key[None], value[None])

        def run() -> torch.Tensor:
            identity = lambda n: Rotation(cos=torch.ones(n, 1, half), sin=torch.zeros(n, 1, half))  # noqa: E731
            band_start = max(0, context - window + 1) if window else 0
            windows = torch.full((chunk,), window, dtype=torch.int64)
            near_from = context + torch.arange(chunk) - windows + 1
            row = PrefillRow(tokens=slice(0, chunk), context=context, seq_len=seq, row=0, near_from=near_from,
                             far_keys=None, band_start=band_start,
                             band_keys=identity(seq - band_start) if window else None)
            queries = QueryPlan(scale=torch.ones(chunk), near=identity(chunk), far=identity(chunk), window=windows)
            return cpu.prefill_kernel(query, queries, cache, torch.arange(cache.shape[0]), row, scale=SCALE,
                                      matrix_tiles=matrix_tiles, rounded_once=rounded_once)

        return run

    return prepare


def plugin_decode(window: int, far_rule: bool, rounded_once: bool = False):
    """The plugin's C++ decode on its own cache layout ``[blocks, kv, bs, 2d]``, with identity
    rotations (its answer is plain attention) but the work of a ``window``-token band and, with
    ``far_rule``, of turning every far key (Leaky ReRoPE, the frequency methods).
    ``rounded_once``: attention_precision bfloat16 (the raw keys' queries rounded once)."""
    from rope_plugins.attention.planner import DECODE_FAR_STEP
    from rope_plugins.ops import cpu, native

    def prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        rows, seq = key.shape[:2]
        half, per_row, step = HEAD_DIM // 2, -(-seq // BLOCK), DECODE_FAR_STEP
        cache = paged(key, value)
        ones = lambda *shape: torch.ones(*shape, half)  # noqa: E731
        zeros = lambda *shape: torch.zeros(*shape, half)  # noqa: E731
        lengths = torch.full((rows,), seq, dtype=torch.int64)
        inputs = native.decode_inputs(  # once per step, as the plugin packs them
            query_scale=torch.ones(rows), query_cos=ones(rows, 2), query_sin=zeros(rows, 2),
            block_table=torch.arange(rows * per_row).view(rows, per_row), seq_lens=lengths,
            window=torch.full((rows,), window, dtype=torch.int64), band_start=(lengths - window).clamp(min=0),
            near_cos=ones(rows, window), near_sin=zeros(rows, window), far_step_cos=ones(1, -(-seq // step)),
            far_step_sin=zeros(1, -(-seq // step)), far_offset_cos=ones(1, step), far_offset_sin=zeros(1, step),
            far_table=torch.full((rows,), 0 if far_rule else -1, dtype=torch.int64))
        # as the engine calls it (rope_plugins/ops/cpu.py): a float32 query, the output in the model's dtype
        once = cpu.rounded_once_on(cache, rounded_once)
        return lambda: native.decode_attention(inputs, query=query.float(), kv_cache=cache, scale=SCALE,
                                               rounded_once=once).to(query.dtype)

    return prepare


def compare(case: str, runs: dict, reps: int, calls: int = 1) -> dict:
    """Each of ``runs`` (functions of no arguments) timed ``calls`` calls per sample, interleaved,
    after an untimed first call (allocation, caches): medians, samples, each as a multiple of
    vLLM's, and the largest difference of any output from vLLM's; said on one line."""
    outputs = {name: run() for name, run in runs.items()}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            began = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - began) / calls)
    medians = {name: statistics.median(t) for name, t in times.items()}
    over_vllm = {name: medians[name] / medians["vllm"] for name in runs}
    difference = max(float((outputs["vllm"] - out).float().abs().max()) for out in outputs.values())
    print(f"{case}: vLLM {medians['vllm'] * 1e3:.2f} ms; x vLLM: "
          + ", ".join(f"{name} {ratio:.2f}" for name, ratio in over_vllm.items() if name != "vllm")
          + f"; max |difference| {difference:.1e}", flush=True)
    return {"seconds": medians, "samples": times, "over_vllm": over_vllm, "max_abs_difference": difference}


def time_decode(reps: int, dtype: torch.dtype) -> list[dict]:
    """Each decode kernel on the same rows, ``DECODE_CALLS`` calls per sample, interleaved."""
    kernels = {"vllm": partial(vllm_kernel, kv_split=True), "plugin_rerope": plugin_decode(REROPE_WINDOW, False),
               "plugin_leaky": plugin_decode(REROPE_WINDOW, True), "plugin_far_rule": plugin_decode(0, True)}
    if dtype == torch.bfloat16:  # ReRoPE's raw keys against queries rounded once too
        kernels["plugin_rerope_rounded_once"] = plugin_decode(REROPE_WINDOW, False, rounded_once=True)
    rows = []
    for batch, seq in DECODE_CASES:
        query = torch.randn(batch, QUERY_HEADS, HEAD_DIM).to(dtype)
        key, value = torch.randn(2, batch, seq, KV_HEADS, HEAD_DIM).to(dtype)
        runs = {name: prepare(query, key, value) for name, prepare in kernels.items()}
        row = {"rows": batch, "keys": seq, **compare(f"decode {batch} x {seq:6,} keys", runs, reps, DECODE_CALLS)}
        cache_bytes = batch * seq * KV_HEADS * 2 * HEAD_DIM * 4
        row["cache_gb_per_second"] = {name: cache_bytes / seconds / 1e9 for name, seconds in row["seconds"].items()}
        rows.append(row)
    return rows


def time_prefill(reps: int, dtype: torch.dtype) -> list[dict]:
    """Each prefill kernel on the same chunks (CASES), interleaved. On a 16-bit cache where the CPU
    has AMX tiles, the plugin's prefill also without them and (bfloat16) with their operands rounded once."""
    from rope_plugins.ops import native

    kernels = {"vllm": vllm_prefill, "torch_flash": torch_prefill, "plugin_far": plugin_prefill(0),
               f"plugin_window_{REROPE_WINDOW}": plugin_prefill(REROPE_WINDOW)}
    if dtype != torch.float32 and native.matrix_tiles_ready():
        kernels["plugin_far_float32_kernel"] = plugin_prefill(0, matrix_tiles=False)
        if dtype == torch.bfloat16:
            kernels["plugin_far_rounded_once"] = plugin_prefill(0, rounded_once=True)
    rows = []
    for context, chunk in CASES:
        query = torch.randn(chunk, QUERY_HEADS, HEAD_DIM).to(dtype)
        key, value = torch.randn(2, context + chunk, KV_HEADS, HEAD_DIM).to(dtype)
        runs = {name: prepare(query, key, value, context) for name, prepare in kernels.items()}
        rows.append({"context": context, "chunk": chunk,
                     **compare(f"context {context:6,} chunk {chunk:6,}", runs, reps)})
    return rows


def kernel_table(rows: list[dict], case: list[str], cells) -> list[str]:
    """A table of ``rows``: ``case`` columns (``cells(row)`` gives them), then each plugin kernel's
    time as a multiple of vLLM's, then the largest difference."""
    others = [name for name in rows[0]["seconds"] if name != "vllm"]
    return ["", harness.markdown_table([*case, *others, "max abs difference"], [
        [*cells(r), *(f"{r['seconds'][name] / r['seconds']['vllm']:.2f}" for name in others),
         f"{r['max_abs_difference']:.1e}"] for r in rows])]


def markdown(report: dict) -> str:
    """attention_kernels.json as bench/README.md shows it."""
    dtype = "" if report.get("dtype", "float32") == "float32" else f", {report['dtype']}"
    lines = [f"Measured {report['date'][:10]} on {report['machine']} ({report['torch_threads']} threads, medians of "
             f"{report['reps']}{dtype}); each kernel's time as a multiple of vLLM's:"]
    lines += kernel_table(report["rows"], ["context", "chunk", "vLLM s"],
                          lambda r: [f"{r['context']:,}", f"{r['chunk']:,}", f"{r['seconds']['vllm']:.3f}"])
    if report.get("decode"):
        lines += ["", f"Decode (one query per row over its cached keys, {DECODE_CALLS} calls per sample, medians of "
                  f"{max(report['reps'], 5)}); vLLM's time with the cache bytes it reads per second, each plugin "
                  "kernel's time as a multiple of vLLM's:"]
        lines += kernel_table(report["decode"], ["rows x keys", "vLLM ms", "vLLM GB/s"],
                              lambda r: [f"{r['rows']} x {r['keys']:,}", f"{r['seconds']['vllm'] * 1e3:.2f}",
                                         f"{r['cache_gb_per_second']['vllm']:.1f}"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="queries, keys and values (vLLM takes its AMX kernel in bfloat16 where the CPU has it)")
    parser.add_argument("--out", type=Path, help="default: bench/results/attention_kernels[_bfloat16].json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    out = args.out or RESULTS / f"attention_kernels{'' if args.dtype == 'float32' else '_' + args.dtype}.json"
    torch.manual_seed(0)
    decode_rows = time_decode(max(args.reps, 5), dtype)
    rows = time_prefill(args.reps, dtype)
    report = harness.header(torch_threads=torch.get_num_threads(), reps=args.reps, dtype=args.dtype, rows=rows,
                            decode=decode_rows)
    print(f"wrote {harness.write_json(report, out)}")
    return 0
