"""Reproduce seed 002's "This Article" row (d = 128, L = 1k .. 1M) on this CPU, timed.

    .venv/bin/python bench/base_bound_row.py

Writes bench/results/base_bound_row.json and bench/results/base_bound_row.png.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's root
from bench.base_bound import base_bound  # noqa: E402

SEED_ROW = {1024 * 2**i: value for i, value in enumerate(
    [4.3e3, 1.2e4, 2.7e4, 8.4e4, 2.3e5, 6.3e5, 2.1e6, 4.9e6, 2.4e7, 5.8e7, 6.5e7])}
RESULTS = Path(__file__).parent / "results"


TARGET_SECONDS = 60  # the issue's target for the whole row on a CPU


def short(value: float, digits: int) -> str:
    """4293.4 -> '4.293e3'."""
    mantissa, exponent = f"{value:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def markdown(report: dict) -> str:
    """base_bound_row.json as bench/README.md shows it: each length against the seed, then the
    largest difference and the time."""
    rows = report["rows"]
    lines = [f"Measured {report['date'][:10]} on {report['machine']}:", "",
             "| L | seed 002 | this search | difference | asymptotic L / 0.6165 |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['length']:,} | {short(r['seed'], 1)} | {short(r['base'], 3)} | {r['relative_to_seed']:+.2%} | "
              f"{short(r['asymptotic'], 3)} |" for r in rows]
    worst = max(rows, key=lambda r: abs(r["relative_to_seed"]))
    below = "below every" if all(r["asymptotic"] < r["base"] for r in rows) else "not below every"
    met = "met" if report["total_seconds"] < TARGET_SECONDS else "not met"
    lines += ["", f"The largest difference from the seed is {abs(worst['relative_to_seed']):.2%} "
                  f"(L = {worst['length']:,}: {short(worst['base'], 3)} against the seed's {short(worst['seed'], 1)}). "
                  f"The asymptotic estimate is {below} exact value. The whole row took {report['total_seconds']:.1f} s "
                  f"(target: under {TARGET_SECONDS} s, {met})."]
    return "\n".join(lines)


def main() -> None:
    rows, start = [], 1.0 + 1e-9
    began = time.perf_counter()
    for length in tqdm(SEED_ROW, desc="base bound, d=128", unit="length"):
        # a base that fails for L fails for 2L: each walk starts at the previous b*
        t0 = time.perf_counter()
        result = base_bound(length, head_dim=128, start=start)
        start = result.base
        rows.append({
            "length": length, "base": result.base, "seed": SEED_ROW[length],
            "relative_to_seed": result.base / SEED_ROW[length] - 1, "asymptotic": result.asymptotic,
            "evaluations": result.evaluations, "uncertified_steps": result.uncertified_steps,
            "seconds": time.perf_counter() - t0,
        })
    total = time.perf_counter() - began

    RESULTS.mkdir(exist_ok=True)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "total_seconds": total, "rows": rows,
    }
    (RESULTS / "base_bound_row.json").write_text(json.dumps(report, indent=2) + "\n")

    lengths = [row["length"] for row in rows]
    plt.figure(figsize=(6, 4))
    plt.loglog(lengths, [row["base"] for row in rows], "o-", label="exact search (this project)")
    plt.loglog(lengths, [row["seed"] for row in rows], "x", markersize=9, label="seed 002, This Article")
    plt.loglog(lengths, [row["asymptotic"] for row in rows], "--", label="asymptotic L / 0.6165")
    plt.xlabel("training length L")
    plt.ylabel("smallest base b*")
    plt.title("RoPE base lower bound, d = 128")
    plt.legend()
    plt.grid(True, which="both", alpha=0.3)
    plt.tight_layout()
    plt.savefig(RESULTS / "base_bound_row.png", dpi=120)

    print(f"{'L':>8} {'b* (ours)':>11} {'seed':>9} {'diff':>7} {'bases':>7} {'s':>6}")
    for row in rows:
        print(f"{row['length']:>8} {row['base']:>11.4g} {row['seed']:>9.2g} {row['relative_to_seed']:>+7.1%}"
              f" {row['evaluations']:>7} {row['seconds']:>6.1f}")
    print(f"whole row: {total:.1f} s  ->  {RESULTS / 'base_bound_row.json'}")


if __name__ == "__main__":
    main()
