"""How close the decode's attention comes to the memory: one long step's KV-cache reads by the
plugin's C++ decode, against PyTorch reading the same bytes, and against the kernel's own
arithmetic with the cache in L2.

    .venv/bin/python bench/decode_bandwidth.py [--keys 32768] [--reps 15]

SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64), one request of ``--keys`` cached
tokens, ``--layers`` layers (30: SmolLM2-135M's), each with its own cache, so that each layer's
cache comes from memory as in a real step (at 32k, 30 x 25 MB in bfloat16, far past the L3).
Per repetition, interleaved:

- ``read``: PyTorch sums each layer's bytes (as float32 words): the machine's read speed;
- ``plugin_rerope`` / ``plugin_leaky``: the plugin's decode over every layer (ReRoPE's shape:
  old keys read raw and a 1024-key band; Leaky ReRoPE's: every key turned by its angle);
- ``..._in_l2``: the same kernel with each layer's block table wrapped into 4 blocks, which
  stay in L2: its arithmetic without the wait for memory;
- ``vllm``: vLLM's CPU decode kernel on its own cache, for scale.

This machine's bandwidth moves by a third within minutes, so each repetition's cache speed
is divided by the read speed of the same repetition and the medians of those shares are
reported. Writes ``bench/results/decode_bandwidth.json`` (bfloat16 and float32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from rope_plugins.plugin import rounded_once_at

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as a script too

from bench import harness  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RESIDENT_BLOCKS = 4  # 4 blocks x 3 kv heads x 128 rows: 384 KB in bfloat16, in one core's L2
TARGET = 0.80  # the share of the read bandwidth for the KV-cache part of a step


def layer_runs(dtype: torch.dtype, layers: int, keys: int, rounded_once: bool = False) -> dict[str, list]:
    """Per kernel, one call per layer (each on its own cache), plus ``read``: each layer's bytes summed.
    ``rounded_once``: the plugin's raw bfloat16 keys scored against its queries rounded once
    (attention_precision bfloat16) rather than their two parts."""
    from bench.attention_kernels import HEAD_DIM, KV_HEADS, QUERY_HEADS, REROPE_WINDOW, plugin_decode, vllm_decode

    query = torch.randn(1, QUERY_HEADS, HEAD_DIM).to(dtype)
    kernels = {"vllm": vllm_decode, "plugin_rerope": plugin_decode(REROPE_WINDOW, False, rounded_once=rounded_once),
               "plugin_leaky": plugin_decode(REROPE_WINDOW, True, rounded_once=rounded_once)}
    runs: dict[str, list] = {name: [] for name in ["read", *kernels]}
    for _ in range(layers):
        key, value = torch.randn(2, 1, keys, KV_HEADS, HEAD_DIM).to(dtype)
        for name, prepare in kernels.items():
            runs[name].append(prepare(query, key, value))
        words = torch.randn(key.nbytes * 2 // 4)  # a layer's cache bytes (keys and values)
        runs["read"].append(words.sum)
    key, value = torch.randn(2, 1, keys, KV_HEADS, HEAD_DIM).to(dtype)
    for window, far_rule, name in ((REROPE_WINDOW, False, "plugin_rerope_in_l2"),
                                   (REROPE_WINDOW, True, "plugin_leaky_in_l2")):
        resident = plugin_decode(window, far_rule, resident_blocks=RESIDENT_BLOCKS,
                                 rounded_once=rounded_once)(query, key, value)
        runs[name] = [resident] * layers
    return runs


def measure(dtype: torch.dtype, layers: int, keys: int, reps: int, rounded_once: bool = False) -> dict:
    """Seconds per layer of each run, ``reps`` interleaved repetitions, and each one's share of
    the read speed (read time over its time, per repetition)."""
    from bench.attention_kernels import HEAD_DIM, KV_HEADS

    runs = layer_runs(dtype, layers, keys, rounded_once)
    for calls in runs.values():  # first calls (allocation, page faults) untimed
        for call in calls:
            call()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, calls in runs.items():
            began = time.perf_counter()
            for call in calls:
                call()
            samples[name].append((time.perf_counter() - began) / layers)
    layer_bytes = keys * KV_HEADS * 2 * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()
    seconds = {name: statistics.median(times) for name, times in samples.items()}
    share = {name: statistics.median(read / took for read, took in zip(samples["read"], times))
             for name, times in samples.items()}
    return {"layer_bytes": layer_bytes, "seconds_per_layer": seconds, "samples": samples,
            "gb_per_second": {name: layer_bytes / took / 1e9 for name, took in seconds.items()},
            "share_of_read": share}


def markdown(report: dict) -> str:
    """decode_bandwidth.json as bench/README.md shows it."""
    lines = [f"Measured {report['date'][:10]} on {report['machine']} ({report['layers']} layers of "
             f"{report['keys']:,} cached tokens, SmolLM2's shapes; bfloat16's attention precision "
             f"{report.get('attention_precision', 'float32')}; medians of {report['reps']} interleaved "
             "repetitions; share: the read's time over the kernel's, per repetition):", "",
             "| dtype | run | ms per layer | GB/s of cache | share of the read speed |",
             "| --- | --- | --- | --- | --- |"]
    for dtype, result in report["dtypes"].items():
        lines += [f"| {dtype} | {name} | {result['seconds_per_layer'][name] * 1e3:.3f} | "
                  f"{result['gb_per_second'][name]:.1f} | {result['share_of_read'][name]:.0%} |"
                  for name in result["seconds_per_layer"]]
    lines.append("")
    for dtype, result in report["dtypes"].items():
        share, seconds = result["share_of_read"], result["seconds_per_layer"]
        lines.append(f"- {dtype}: the plugin's decode reads the cache at {share['plugin_rerope']:.0%} (ReRoPE) and "
                     f"{share['plugin_leaky']:.0%} (Leaky ReRoPE) of the read speed (target {TARGET:.0%}: "
                     f"{'met' if min(share['plugin_rerope'], share['plugin_leaky']) >= TARGET else 'not met'}); "
                     f"its arithmetic alone, with the cache in L2, takes "
                     f"{seconds['plugin_rerope_in_l2'] / seconds['read']:.2f}x and "
                     f"{seconds['plugin_leaky_in_l2'] / seconds['read']:.2f}x the read's time.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.speed import add_attention_precision

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    add_attention_precision(parser, "bfloat16's raw keys against queries rounded once (bfloat16) or in two parts "
                                    "(float32)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_bandwidth.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    report = {"date": harness.now(),
              "machine": harness.machine(),
              "threads": torch.get_num_threads(), "keys": args.keys, "layers": args.layers, "reps": args.reps,
              "target": TARGET, "attention_precision": args.attention_precision, "dtypes": {}}
    for dtype in args.dtypes:
        report["dtypes"][dtype] = measure(getattr(torch, dtype), args.layers, args.keys, args.reps,
                                          rounded_once=rounded_once_at(args.attention_precision))
        print(f"{dtype}: " + ", ".join(f"{name} {took * 1e3:.3f} ms"
                                       for name, took in report["dtypes"][dtype]["seconds_per_layer"].items()),
              flush=True)
    harness.write_json(report, args.out)
    print(markdown(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
