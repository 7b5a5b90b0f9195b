"""The Triton kernels' speed on a GPU at real sizes, beside PyTorch's FlashAttention (no vLLM needed).

    .venv/bin/python -m bench gpu-kernels                       # Llama 3 8B heads, bfloat16
    .venv/bin/python -m bench gpu-kernels --prefill 8192 --decode-context 16384 --decode-rows 8

- **Prefill**: a first chunk of ``--prefill`` tokens over a shuffled paged cache, per method and
  launch (query tile, key tile, warps), against causal FlashAttention on the same keys and
  values rotated beforehand (the plugin rotates inside, and scores ReRoPE's straddling tiles twice).
- **Decode**: ``--decode-rows`` rows of ``--decode-context`` keys, one query each; cache bytes read
  per second, against FlashAttention on the GQA heads.
- **Check**: ``none`` against FlashAttention on keys rotated by PyTorch in float32.

Medians of ``triton.testing.do_bench``; writes ``--out``. PyTorch's FlashAttention is FA-2;
vLLM's on Hopper is FA-3 on the paged cache, which this does not run.
"""

from __future__ import annotations

import argparse
import traceback
from functools import partial
from pathlib import Path

import torch

from bench import harness
from rope_plugins.attention.planner import QUERY_TILE

RESULTS = harness.RESULTS
BLOCK = 16  # tokens per cache block (vLLM's default on CUDA)
BASE = 500000.0  # Llama 3's rotary base
TRAIN = 8192
METHODS = {"none": dict(method="none"), "rerope": dict(method="rerope", window=TRAIN // 4),
           "leaky_rerope": dict(method="leaky_rerope", window=TRAIN // 4, leaky_k=16.0),
           "ntk_mixed": dict(method="ntk_mixed", factor=4.0), "yarn": dict(method="yarn", factor=4.0)}


def paged_cache(seq_lens: list[int], kv: int, head: int, dtype: torch.dtype, device, generator):
    """A random paged cache holding each row's keys and values, and the rows' block table."""
    blocks_per_row = [-(-n // BLOCK) for n in seq_lens]
    cache = torch.randn(sum(blocks_per_row) + 1, kv, BLOCK, 2 * head, generator=generator, device=device).to(dtype)
    order = torch.randperm(cache.shape[0], generator=generator, device=device)
    table = torch.zeros(len(seq_lens), max(blocks_per_row), dtype=torch.int32, device=device)
    for r, blocks in enumerate(order[: sum(blocks_per_row)].split(blocks_per_row)):
        table[r, : len(blocks)] = blocks
    return cache, table


def plan_for(methods: list[str], query_lens: list[int], seq_lens: list[int], table, head: int, device,
             query_tile: int = QUERY_TILE):
    """The engine's KernelPlan for rows of the given methods."""
    from rope_plugins.attention.planner import kernel_plan
    from rope_plugins.rules.checkpoint import CheckpointRotary
    from rope_plugins.rules.settings import ExtensionSettings
    from rope_plugins.worker.row_tables import RowTables, row_values

    tables = RowTables(len(methods), head // 2)
    rotary = CheckpointRotary.plain(head, BASE, TRAIN)
    for r, method in enumerate(methods):
        tables.write(r, row_values(ExtensionSettings(train_length=TRAIN, **METHODS[method]), rotary))
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return kernel_plan(tables, query_start_cpu=starts, query_start=starts.to(device, torch.int32),
                       seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), max_seq_len=max(seq_lens),
                       block_table=table, slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
                       query_tile=query_tile)


def rotated(x: torch.Tensor, positions: torch.Tensor, head: int) -> torch.Tensor:
    """Neox-style rotary of ``x`` ``[T, heads, d]`` at ``positions``, in float32."""
    theta = BASE ** (-torch.arange(0, head, 2, dtype=torch.float64, device=x.device) / head)
    angle = positions.double()[:, None] * theta
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
    first, second = x.float().chunk(2, -1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), -1)


def contiguous_kv(cache: torch.Tensor, table: torch.Tensor, row: int, length: int, head: int):
    """Row ``row``'s keys and values ``[length, kv, d]`` out of the paged cache."""
    position = torch.arange(length, device=cache.device)
    entries = cache[table[row, position // BLOCK].long(), :, position % BLOCK]
    return entries[..., :head], entries[..., head:]


def flash(query, key, value, *, causal: bool) -> torch.Tensor:
    """PyTorch's FlashAttention on ``[B, heads, T, d]`` (GQA by ``enable_gqa``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                                enable_gqa=key.shape[1] != query.shape[1])


def timed(fn) -> float:
    """Median milliseconds of ``fn``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def time_launches(runs, output: torch.Tensor, expected: torch.Tensor, baseline_ms: float, rates) -> dict:
    """Each of ``runs`` ((method, label, fields, run)) timed and said: per method the launches that
    ran (one that fails, e.g. out of shared memory, is said and left out), each its median
    milliseconds, its ``fields``, its time as a multiple of FlashAttention's and ``rates(ms)``;
    ``none``'s also its output's largest difference from ``expected``, relative to its largest value."""
    methods = {}
    for method, label, fields, run in runs:
        try:
            entry = {"ms": timed(run)}
        except Exception as error:
            print(f"{label}: {type(error).__name__}: {error}"[:300], flush=True)
            continue
        if method == "none":
            run()
            entry["relative_error_vs_flash"] = float((output.float() - expected).abs().max() / expected.abs().max())
        ms, per_ms = entry["ms"], rates(entry["ms"])
        entry.update(**fields, x_flash=ms / baseline_ms, **per_ms)
        methods.setdefault(method, []).append(entry)
        print(f"{label}: {ms:8.3f} ms, {ms / baseline_ms:5.2f}x flash ({baseline_ms:.3f} ms)"
              + "".join(f", {name} {value:.0f}" for name, value in per_ms.items()), flush=True)
    return methods


def prefill_speed(args, device, generator) -> dict:
    from rope_plugins.ops import gpu

    heads, kv, head, n, dtype = args.heads, args.kv_heads, args.head, args.prefill, args.torch_dtype
    cache, table = paged_cache([n], kv, head, dtype, device, generator)
    query = torch.randn(n, heads, head, generator=generator, device=device).to(dtype)
    output = torch.empty_like(query)
    scale = head ** -0.5
    key, value = contiguous_kv(cache, table, 0, n, head)
    positions = torch.arange(n, device=device)
    q = rotated(query, positions, head).to(dtype).transpose(0, 1)[None]
    k = rotated(key, positions, head).to(dtype).transpose(0, 1)[None]
    v = value.transpose(0, 1)[None].contiguous()
    baseline_ms = timed(lambda: flash(q, k, v, causal=True))
    flops = 4 * heads * head * n * (n + 1) / 2  # QK^T and PV over the causal half
    result = {"tokens": n, "flash_ms": baseline_ms, "flash_tflops": flops / baseline_ms / 1e9}
    expected = flash(q, k, v, causal=True)[0].transpose(0, 1).float()
    swept = [(tile, key_tile, warps) for tile in args.query_tiles for key_tile in args.key_tiles
             for warps in args.warps]
    runs = ((method, f"prefill {n}: {method:<13} q{tile:>3} k{key_tile:>3} w{warps}",
             dict(query_tile=tile, key_tile=key_tile, num_warps=warps),
             partial(gpu.prefill, query, cache, plan_for([method], [n], [n], table, head, device, query_tile=tile),
                     output, scale=scale, key_tile=key_tile, num_warps=warps))
            for method in args.methods
            for tile, key_tile, warps in (swept if method in args.sweep_methods else [swept[0], args.best_prefill]))
    result["methods"] = time_launches(runs, output, expected, baseline_ms, lambda ms: {"tflops": flops / ms / 1e9})
    return result


def decode_speed(args, device, generator) -> dict:
    from rope_plugins.ops import gpu

    heads, kv, head, rows, n, dtype = (args.heads, args.kv_heads, args.head, args.decode_rows, args.decode_context,
                                       args.torch_dtype)
    cache, table = paged_cache([n] * rows, kv, head, dtype, device, generator)
    query = torch.randn(rows, heads, head, generator=generator, device=device).to(dtype)
    output = torch.empty_like(query)
    scale = head ** -0.5
    cache_bytes = rows * n * kv * head * 2 * cache.element_size()
    keys = [contiguous_kv(cache, table, r, n, head) for r in range(rows)]
    positions = torch.arange(n, device=device)
    k = torch.stack([rotated(key, positions, head).to(dtype).transpose(0, 1) for key, _ in keys])
    v = torch.stack([value.transpose(0, 1) for _, value in keys]).contiguous()
    q = rotated(query, torch.full((rows,), n - 1, device=device), head).to(dtype)[:, :, None]
    baseline_ms = timed(lambda: flash(q, k, v, causal=False))
    expected = flash(q, k, v, causal=False)[:, :, 0].float()
    result = {"rows": rows, "context": n, "cache_bytes": cache_bytes, "flash_ms": baseline_ms,
              "flash_gbps": cache_bytes / baseline_ms / 1e6}
    launches = decode_launches(args)

    def runs():
        for method in args.methods:
            plan = plan_for([method] * rows, [1] * rows, [n] * rows, table, head, device)
            for launch in launches if method in args.sweep_methods else launches[:1]:
                yield (method, f"decode {rows} x {n}: {method:<13} k{launch['key_tile']:>3} w{launch['num_warps']} "
                       f"{'dot' if launch['dot'] else 'sum'}{' tile-angles' if launch['tile_angles'] else ''}",
                       dict(launch, splits=plan.decode_rows.splits, split_keys=plan.decode_rows.split_keys),
                       partial(gpu.decode, query, cache, plan, output, scale=scale, **launch))

    result["methods"] = time_launches(runs(), output, expected, baseline_ms,
                                      lambda ms: {"gbps": cache_bytes / ms / 1e6})
    return result


def decode_launches(args) -> list[dict]:
    """The decode launches to time: the kernels' own first, then every key tile x warps x angle
    rule by ``tl.dot``, then the broadcast sums at ``--decode-key-tiles``' first tile (the decode
    before ``tl.dot``)."""
    from rope_plugins.ops import gpu

    default = dict(key_tile=gpu.DECODE_KEY_TILE, num_warps=gpu.DECODE_WARPS, dot=gpu.DECODE_DOT,
                   tile_angles=gpu.DECODE_TILE_ANGLES)
    swept = [dict(key_tile=k, num_warps=w, dot=True, tile_angles=a) for k in args.decode_key_tiles
             for w in args.decode_warps for a in (False, True)]
    broadcast = [dict(key_tile=args.decode_key_tiles[0], num_warps=4, dot=False, tile_angles=False)]
    return [default, *(launch for launch in swept + broadcast if launch != default)]


def entries(part: dict) -> dict[str, list[dict]]:
    """Each method's timed launches; a launch that names no tile, warps or decode products ran
    the kernels' own of this script's first versions (key tile 32, 4 warps, broadcast sums)."""
    defaults = {"key_tile": 32, "num_warps": 4, "dot": False, "tile_angles": False}
    return {method: [{**defaults, **entry} for entry in runs] for method, runs in part.get("methods", {}).items()}


def best_launches(report: dict) -> dict:
    """The fastest launch of each method, for prefill and for decode."""
    return {f"{part}_best": {method: min(runs, key=lambda e: e["ms"]) for method, runs in entries(report[part]).items()}
            for part in ("prefill", "decode") if "methods" in report.get(part, {})}


def markdown(report: dict, parts: tuple[str, ...] = ("prefill", "decode")) -> str:
    """The fastest launch of each method against FlashAttention, a table per part in ``parts``."""
    best, shape = best_launches(report), report["shape"]
    lines = [f"Measured {report['date'][:10]} on an {report['gpu']} (torch {report['torch']}, Triton "
             f"{report['triton']}): {shape['heads']} query / {shape['kv_heads']} KV heads of {shape['head']}, "
             f"{shape['dtype']}, 16-token blocks. The fastest launch of each method; FlashAttention is PyTorch's."]
    if "prefill" in parts and best.get("prefill_best"):
        part = report["prefill"]
        lines += [f"Prefill of {part['tokens']:,} tokens (FlashAttention {part['flash_ms']:.2f} ms, "
                  f"{part['flash_tflops']:.0f} TFLOP/s):", harness.markdown_table(
                      ["method", "ms", "x flash", "TFLOP/s", "query tile", "key tile", "warps"],
                      [[m, f"{e['ms']:.2f}", f"{e['x_flash']:.2f}", f"{e['tflops']:.0f}", e["query_tile"],
                        e["key_tile"], e["num_warps"]] for m, e in best["prefill_best"].items()])]
    if "decode" in parts and best.get("decode_best"):
        part = report["decode"]
        lines += [f"Decode, {part['rows']} rows of {part['context']:,} keys (FlashAttention {part['flash_ms']:.3f} ms, "
                  f"{part['flash_gbps']:.0f} GB/s of cache):", harness.markdown_table(
                      ["method", "ms", "x flash", "GB/s", "key tile", "warps", "products", "key angles"],
                      [[m, f"{e['ms']:.3f}", f"{e['x_flash']:.2f}", f"{e['gbps']:.0f}", e["key_tile"], e["num_warps"],
                        "tl.dot" if e["dot"] else "broadcast sums", "per tile" if e["tile_angles"] else "per key"]
                       for m, e in best["decode_best"].items()])]
    errors = [e["relative_error_vs_flash"] for part in parts for runs in entries(report.get(part, {})).values()
              for e in runs if "relative_error_vs_flash" in e]
    if errors:
        lines.append(f"Plain RoPE (`none`) against FlashAttention on keys rotated by PyTorch, every launch: largest "
                     f"difference {max(errors):.4f} of the largest output ({shape['dtype']}'s rounding step is "
                     f"{torch.finfo(getattr(torch, shape['dtype'])).eps:.4f}).")
    return "\n\n".join(lines)


def prefill_markdown(report: dict) -> str:
    """The prefill part alone (a later run's decode supersedes this one's)."""
    return markdown(report, ("prefill",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--prefill", type=int, default=16384, help="tokens of the prefill chunk (context 0)")
    parser.add_argument("--query-tiles", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--key-tiles", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sweep-methods", nargs="+", choices=list(METHODS), default=["none", "rerope", "leaky_rerope"],
                        help="methods timed at every launch; the others at the first and --best-prefill")
    parser.add_argument("--best-prefill", type=int, nargs=3, default=[128, 64, 8], metavar=("QTILE", "KTILE", "WARPS"))
    parser.add_argument("--decode-key-tiles", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--decode-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--skip-prefill", action="store_true", help="time the decode only")
    parser.add_argument("--decode-rows", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=32768)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_kernel_speed.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_speed: no CUDA device here")
        return 2
    args.torch_dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    report = {"date": harness.now(), **harness.gpu_versions(device),
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head": args.head, "dtype": args.dtype,
                        "block": BLOCK, "base": BASE, "train_length": TRAIN}}
    for part, speed in (("decode", decode_speed), *(() if args.skip_prefill else [("prefill", prefill_speed)])):
        try:
            report[part] = speed(args, device, generator)
        except Exception as error:  # keep the other part's numbers
            report[part] = {"error": traceback.format_exc(limit=-4)}
            print(f"{part} failed: {type(error).__name__}: {error}", flush=True)
        harness.write_json(report, args.out)
        torch.cuda.empty_cache()
    report.update(best_launches(report))
    print(markdown(report))
    print(f"wrote {harness.write_json(report, args.out)}")
    return 0
