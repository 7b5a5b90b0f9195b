"""Are the Triton kernels (``rope_plugins/ops/gpu.py``) right on this GPU? (Their speed: ``bench gpu-kernels``.)

    .venv/bin/python -m tests.ops.gpu_check                # on CUDA device 0 (a few minutes)
    .venv/bin/python -m tests.ops.gpu_check --interpret    # small, on this CPU

One paged step per (head shape, dtype, KV cache): Llama 3 8B's heads (32 q / 8 kv, d128), Qwen2.5 7B's
(28 / 4) and 0.5B's (14 / 2, d64); float32, float16, bfloat16. A step holds rows of every method
(some with log-n): prefill chunks after a cached context, a first chunk, decode rows at 2,000 to
8,000 keys. The cache-write kernel writes the step's keys (and padded tokens at slot -1, which
it must skip), then prefill and decode run with the engine's plan; the output is compared with
the float64 oracle (rope_plugins/testing/reference.py), relative to each row's largest output
(``TOLERANCE``). ``--interpret`` runs small sizes under Triton's interpreter in float32 and
float16 (its bfloat16 dots are not trustworthy). Writes ``--out`` after each case. Exit status:
0 all within tolerance, 1 not, 2 no CUDA device and no ``--interpret``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bench import harness
from rope_plugins.attention.planner import MIN_SPLIT_KEYS, QUERY_TILE

RESULTS = harness.RESULTS
BLOCK = 16  # tokens per cache block (vLLM's default on CUDA)
PADDED = 3  # padded tokens (slot -1) in every cache write
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest error allowed, relative to the largest output of its row (|kernel - oracle| / max
# |oracle|: rows of thousands of keys have small outputs, a first chunk's first tokens large
# ones). Seen under the interpreter: float32 (IEEE dots) below 1e-6, float16 below 7e-4;
# bfloat16 keeps 3 fewer mantissa bits than float16 (8x its rounding).
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
# The caches a case can hold, by vLLM's --kv-cache-dtype names: the model's dtype, or fp8 by
# per-tensor scales that are no power of two (a scale applied twice or not at all shows). The
# oracle reads the values an fp8 cache holds: the tolerance is the model dtype's, fp8's own
# rounding is the quality table's matter (docs/usage.md).
CACHE_FORMATS = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_SCALES = (0.37, 1.7)  # (key, value)


@dataclass(frozen=True)
class Shape:
    """The attention heads of a model."""

    label: str
    head: int
    kv: int
    queries_per_kv: int  # the GQA ratio: query heads per KV head


@dataclass(frozen=True)
class Sizes:
    """A set of head shapes and rows, and the launch parameters to run them with."""

    shapes: tuple[Shape, ...]
    train_length: int
    rows: tuple[tuple[dict, int, int], ...]  # (settings fields, context, new tokens)
    query_tile: int = QUERY_TILE  # the engine's by default
    min_split_keys: int = MIN_SPLIT_KEYS


def decoding_every_method(train_length: int, contexts: tuple[int, ...]) -> tuple:
    """One decode row per method (three with log-n) after ``contexts`` cached tokens; windows
    a quarter of the training length (the default); dual-chunk's defaults where they fit (from 128)."""
    window = train_length // 4
    dual_chunk = dict(method="dual_chunk") if train_length >= 128 else dict(method="dual_chunk", chunk_size=64,
                                                                            local_window=0)
    fields = (dict(method="rerope", window=window),
              dict(method="leaky_rerope", window=window, leaky_k=16.0, log_n=True),
              dict(method="ntk_mixed", factor=4.0, log_n=True), dict(method="yarn", factor=4.0),
              dict(method="pi", factor=4.0), dict(method="ntk_old", factor=8.0),
              dict(method="ntk_fixed", factor=4.0, log_n=True), dict(method="none"),
              dict(method="self_extend", window=window, group=8, log_n=True), dict(method="ntk_dynamic"),
              dict(method="string"), dual_chunk)
    return tuple((chosen, context, 1) for chosen, context in zip(fields, contexts, strict=True))


REAL = Sizes(
    shapes=(Shape("d128, 32 q / 8 kv heads (Llama 3 8B)", 128, 8, 4),
            Shape("d128, 28 q / 4 kv heads, 7:1 (Qwen2.5 7B)", 128, 4, 7),
            Shape("d64, 14 q / 2 kv heads, 7:1 (Qwen2.5 0.5B)", 64, 2, 7)),
    train_length=4096,
    rows=(
        # prefill: chunks after a cached context (windows no multiple of the tiles), a first chunk
        (dict(method="rerope", window=1000, log_n=True), 3968, 256),
        (dict(method="leaky_rerope", window=500, leaky_k=16.0), 0, 512),
        (dict(method="ntk_mixed", factor=4.0), 2944, 128),
        (dict(method="yarn", factor=4.0, log_n=True), 5000, 128),
        (dict(method="self_extend", window=1000, group=16), 4000, 256),
        (dict(method="ntk_dynamic", log_n=True), 4000, 256),  # its θ steps at 4096 and 4224
        (dict(method="string", shift=1365, local=128), 3000, 256),
        (dict(method="dual_chunk"), 5500, 256),  # chunks of 2816: across the edge at 5632
        # decode rows at several thousand keys
        *decoding_every_method(4096, (8191, 6000, 7000, 5500, 4500, 3000, 6500, 2000, 7500, 5000, 6200, 5700)),
    ),
)
# Small enough for Triton's interpreter; decode splits of 32 keys so that rows span several.
SMALL = Sizes(
    shapes=(Shape("d64, 6 q / 2 kv heads", 64, 2, 3), Shape("d128, 7 q / 1 kv head, 7:1", 128, 1, 7)),
    train_length=64,
    rows=(
        (dict(method="rerope", window=37, log_n=True), 40, 30),
        (dict(method="leaky_rerope", window=20, leaky_k=4.0), 0, 24),
        (dict(method="ntk_mixed", factor=4.0), 20, 17),
        (dict(method="self_extend", window=12, group=4), 30, 20),
        (dict(method="ntk_dynamic", log_n=True), 50, 30),  # its θ steps at 64
        (dict(method="string", shift=21, local=5), 25, 30),
        (dict(method="dual_chunk", chunk_size=64, local_window=0), 50, 30),
        *decoding_every_method(64, (130, 100, 90, 75, 70, 66, 110, 50, 120, 200, 140, 150)),
    ),
    query_tile=16, min_split_keys=32,
)


def step_rows(sizes: Sizes) -> list:
    """The sizes' rows as the step builder takes them: (settings, context, new tokens)."""
    from rope_plugins.rules.settings import ExtensionSettings

    return [(ExtensionSettings(train_length=sizes.train_length, **fields), context, new)
            for fields, context, new in sizes.rows]


def finite(value: float) -> float | None:
    """The value, or None (null in strict JSON) where it is not finite."""
    return value if math.isfinite(value) else None


def row_errors(output: torch.Tensor, expected: torch.Tensor) -> dict:
    """One row's largest |output - expected|, its largest |expected|, and their ratio; an
    output that is not finite (never written) is an infinite error, reported as null."""
    error = float((output.double() - expected).abs().nan_to_num(nan=math.inf).max())
    scale = float(expected.abs().max())
    return {"max_error": error, "scale": scale, "relative_error": error / scale}


def run_kernels(step, device: torch.device, sizes: Sizes, key_tiles: dict[str, int],
                fp8: torch.dtype | None = None) -> tuple[torch.Tensor, bool]:
    """The step through the three kernels as the engine runs them: its keys and values written
    (with padded tokens) into a cache whose slots for them hold NaN, then prefill and decode; an
    ``fp8`` cache (the step's holds its bytes) by FP8_SCALES. Returns the output (CPU, which waits
    for the kernels) and whether the cache write left the cache exactly right."""
    from rope_plugins.attention.planner import kernel_plan
    from rope_plugins.ops import gpu

    step = step.to(device)
    cache, scales = step.cache.clone(), dict(zip(("key_scale", "value_scale"), FP8_SCALES)) if fp8 else {}
    cache[step.slots // BLOCK, :, step.slots % BLOCK] = 0x7F if fp8 else float("nan")  # 0x7F: fp8's NaN
    cache = cache.view(fp8) if fp8 else cache
    garbage = torch.randn(PADDED, *step.key.shape[1:], device=device).to(step.key.dtype)
    slots = torch.cat((step.slots, torch.full((PADDED,), -1, dtype=step.slots.dtype, device=device)))
    gpu.write_cache(torch.cat((step.key, garbage)), torch.cat((step.value, garbage)), cache, slots, **scales)
    plan = kernel_plan(step.tables, query_start_cpu=step.starts.cpu(), query_start=step.starts.to(torch.int32),
                       seq_lens=step.seq_lens.to(torch.int32), max_seq_len=int(step.seq_lens.max()),
                       block_table=step.block_table.to(torch.int32), slot_mapping=slots[: -PADDED],
                       query_tile=sizes.query_tile, min_split_keys=sizes.min_split_keys)
    output = torch.full_like(step.query, float("nan"))
    scale = step.query.shape[-1] ** -0.5
    gpu.prefill(step.query, cache, plan, output, scale=scale, key_tile=key_tiles["prefill"], **scales)
    gpu.decode(step.query, cache, plan, output, scale=scale, key_tile=key_tiles["decode"], **scales)
    return output.cpu(), torch.equal(cache.view(torch.uint8) if fp8 else cache, step.cache)


def check_case(step, expected: list[torch.Tensor], shape: Shape, dtype: str, cache: str, tolerance: float,
               device: torch.device, sizes: Sizes, key_tile: int | None) -> dict:
    """One step in one dtype on one cache against the oracle's rows: what ran, the errors and the
    verdict (a kernel that raised, e.g. bfloat16 before Ampere, is a failed case with its error). The
    kernels run with ``key_tile`` keys per inner step, or (None) each its own."""
    from rope_plugins.ops import gpu

    key_tiles = {"prefill": key_tile or gpu.PREFILL_KEY_TILE, "decode": key_tile or gpu.DECODE_KEY_TILE}
    case = {"shape": shape.label, "head": shape.head, "q_heads": shape.kv * shape.queries_per_kv, "kv_heads": shape.kv,
            "dtype": dtype, "kv_cache_dtype": cache, "key_tiles": key_tiles, "tolerance": tolerance}
    try:
        output, cache_exact = run_kernels(step, device, sizes, key_tiles, CACHE_FORMATS[cache])
    except Exception as error:
        return {**case, "cache_write_exact": False, "max_error": None, "relative_error": None, "passed": False,
                "rows": [], "error": f"{type(error).__name__}: {error}"[:4000]}
    errors = [row_errors(output[int(step.starts[r]): int(step.starts[r + 1])], oracle)
              for r, oracle in enumerate(expected)]
    worst = {key: max(error[key] for error in errors) for key in ("max_error", "relative_error")}
    rows = [{"settings": settings.canonical(), "context": context, "new": new,
             **{key: finite(value) for key, value in error.items()}}
            for (settings, context, new), error in zip(step.rows, errors)]
    return {**case, "tokens": int(step.starts[-1]), "keys": int(step.seq_lens.sum()), "cache_write_exact": cache_exact,
            **{key: finite(value) for key, value in worst.items()},
            "passed": cache_exact and worst["relative_error"] <= tolerance, "rows": rows}


def cached(step, cache: str):
    """The step on a ``cache`` (``auto``: its own; an fp8 format: its bytes by FP8_SCALES), and the
    step the oracle reads (an fp8 cache's keys and values as they read back)."""
    from rope_plugins.testing.paged_steps import fp8_cached

    if CACHE_FORMATS[cache] is None:
        return step, step
    bytes_, oracle = fp8_cached(step, CACHE_FORMATS[cache], *FP8_SCALES)
    return dataclasses.replace(step, cache=bytes_), oracle


def verdict(cases: list[dict], complete: bool = True) -> dict:
    """Part 1's record: passed where the run is complete, has cases, and every one passed."""
    return {"passed": complete and bool(cases) and all(case["passed"] for case in cases), "complete": complete,
            "block_size": BLOCK, "cases": cases}


def check_kernels(sizes: Sizes, dtypes: list[str], tolerances: dict[str, float], device: torch.device, *,
                  key_tiles: tuple[int | None, ...] = (None,), caches: tuple[str, ...] = ("auto",),
                  on_case=lambda cases: None) -> dict:
    """Part 1: every shape in every dtype on every cache, at every key tile (None: the kernels'
    own); the oracle once per shape and cache. ``on_case`` sees the cases so far after each (a
    run cut short keeps them)."""
    from tqdm import tqdm

    from rope_plugins.testing.paged_steps import paged_step

    rows, cases = step_rows(sizes), []
    with tqdm(total=len(sizes.shapes) * len(caches) * (len(rows) + len(dtypes) * len(key_tiles)), desc="kernels",
              unit="step") as bar:
        for (seed, shape), cache in itertools.product(enumerate(sizes.shapes), caches):
            build = partial(paged_step, rows, seed=seed, head=shape.head, kv=shape.kv,  # this shape's step, in a dtype
                            queries_per_kv=shape.queries_per_kv, block=BLOCK, grid=torch.bfloat16)
            reference, oracle = cached(build(dtype=DTYPES["float32"]), cache)
            expected = []
            for r in range(len(rows)):
                bar.set_postfix_str(f"oracle: {shape.label}, {cache} cache, row {r + 1}/{len(rows)}")
                expected.append(oracle.expected_row(r))
                bar.update()
            for dtype in dtypes:
                step = cached(build(dtype=DTYPES[dtype]), cache)[0]
                assert torch.equal(step.query.float(), reference.query), "the dtypes' steps must hold the same numbers"
                for key_tile in key_tiles:
                    bar.set_postfix_str(f"kernels: {shape.label}, {dtype}, {cache}, key tile {key_tile or 'default'}")
                    cases.append(check_case(step, expected, shape, dtype, cache, tolerances[dtype], device, sizes,
                                            key_tile))
                    on_case(cases)
                    bar.update()
    return verdict(cases)


def number(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.2e}"


def markdown(report: dict) -> str:
    """Part 1's verdicts as a table (bench/readme.py's block of gpu_check.json)."""
    env, kernels = report["environment"], report.get("kernels") or {"cases": []}
    table = harness.markdown_table(
        ["heads", "dtype", "KV cache", "key tiles", "error", "relative", "allowed", "cache write", "verdict"],
        [[case["shape"], case["dtype"], case.get("kv_cache_dtype", "auto"),
          f"{case['key_tiles']['prefill']}/{case['key_tiles']['decode']}", number(case["max_error"]),
          number(case["relative_error"]), f"{case['tolerance']:.0e}", "exact" if case["cache_write_exact"] else "wrong",
          "pass" if case["passed"] else "FAIL"] for case in kernels["cases"]])
    result = "every case passed" if kernels.get("passed") else "some cases failed or did not run"
    return (f"Checked {report['date'][:10]} on an {env['gpu'] or 'interpreter'} (CUDA {env['cuda']}, torch "
            f"{env['torch']}, Triton {env['triton']}): largest error against the float64 oracle, relative to the "
            f"largest output of its row; key tiles: prefill's/decode's.\n\n{table}\n\nKernels: {result}.")


def failures(report: dict) -> str:
    """What failed, row by row, under the table."""
    lines = []
    for case in (report.get("kernels") or {"cases": []})["cases"]:
        named = f"{case['shape']}, {case['dtype']}, {case.get('kv_cache_dtype', 'auto')} cache"
        if "error" in case:
            lines.append(f"{named}: raised {case['error'].splitlines()[0][:200]}")
        for row in case["rows"] if not case["passed"] else []:
            lines.append(f"{named}: {row['settings']} context {row['context']} + {row['new']}: "
                         f"{number(row['max_error'])}, relative {number(row['relative_error'])}")
    return "\n".join(lines)


def tolerance(item: str) -> tuple[str, float]:
    """``--tolerance``'s DTYPE=VALUE."""
    dtype, _, value = item.partition("=")
    if dtype not in DTYPES or not value:
        raise argparse.ArgumentTypeError(f"DTYPE=VALUE with DTYPE one of {', '.join(DTYPES)}, not {item!r}")
    return dtype, float(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="on this CPU under Triton's interpreter")
    parser.add_argument("--sizes", choices=["real", "small"], help="default: real on CUDA, small under --interpret")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                        help="dtypes (default: all three on CUDA, float32 and float16 under --interpret)")
    parser.add_argument("--tolerance", action="append", type=tolerance, default=[], metavar="DTYPE=VALUE",
                        help=f"largest relative error allowed for a dtype (default {TOLERANCE})")
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=list(CACHE_FORMATS),
                        help="caches (default: all three on CUDA, auto and fp8_e4m3 under --interpret)")
    parser.add_argument("--key-tiles", type=int, nargs="+", default=[None],
                        help="keys per inner step of both attention kernels, each checked (default: each kernel's own)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: before rope_plugins.ops.gpu loads
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu_check: no CUDA device here. It checks the Triton kernels on a GPU;\n"
              "  --interpret checks the kernels at small sizes on this CPU under Triton's interpreter instead.",
              file=sys.stderr)
        return 2
    sizes = {"real": REAL, "small": SMALL}[args.sizes or ("small" if args.interpret else "real")]
    dtypes = args.dtypes or (["float32", "float16"] if args.interpret else list(DTYPES))
    caches = args.kv_cache_dtypes or (["auto", "fp8_e4m3"] if args.interpret else list(CACHE_FORMATS))
    report = {"date": harness.now(), "mode": "interpreter" if args.interpret else "cuda",
              "environment": harness.gpu_versions(device)}

    def write(kernels: dict) -> None:
        report["kernels"] = kernels
        harness.write_json(report, args.out, allow_nan=False)

    kernels = check_kernels(sizes, dtypes, {**TOLERANCE, **dict(args.tolerance)}, device,
                            key_tiles=tuple(args.key_tiles), caches=tuple(caches),
                            on_case=lambda cases: write(verdict(cases, complete=False)))
    write(verdict(kernels["cases"]))
    print(markdown(report), failures(report), sep="\n\n")
    print(f"\nwrote {args.out}")
    return 0 if report["kernels"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
