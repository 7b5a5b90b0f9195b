"""The step budget (``--max-num-batched-tokens``) under long prompts: how long a decoding request
waits between tokens while another's prompt is prefilled (a step runs one whole chunk of it),
against how fast prompts go through.

    .venv/bin/python -m bench load                          # budgets 8192 and 2048
    .venv/bin/python -m bench load --budgets 2048 --reserved-cores 0 1 --out bench/results/reserved_cores.json

Per budget (and ``--reserved-cores``: ``VLLM_CPU_NUM_OF_RESERVED_CPU``), a server with
``make run``'s settings and ``--enforce-eager``, and the same load test (deploy/loadtest.py)
against it. Writes bench/results/step_budget.json (``--out``) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from bench import harness

RESULTS = harness.RESULTS
# the load-test run of bench/README.md: prompts of 1k-12k tokens (past the 8k training length), two at a time
WORKLOAD = ["--requests", "8", "--concurrency", "2", "--prompt-lengths", "1024,4096,8192,12288",
            "--output-tokens", "32", "--mix", "auto=1,rerope=1,ntk_mixed=1"]


def run_config(budget: int, reserved: int | None, out_dir: Path) -> dict:
    from rope_plugins.deploy import loadtest
    from rope_plugins.frontend.engine_args import RESERVED_CORES_ENV
    from rope_plugins.testing.launcher import running_server

    flags = ["--max-num-batched-tokens", str(budget), "--enforce-eager", "--log-level", "warning"]
    name = f"step_budget_{budget}" + ("" if reserved is None else f"_reserved{reserved}")
    env = {} if reserved is None else {RESERVED_CORES_ENV: str(reserved)}
    report_path = out_dir / f"{name}.json"
    with running_server(flags, out_dir / f"{name}_server.log", env) as server:
        loadtest.main(["--url", server.base, *WORKLOAD, "--out", str(report_path)])
    report = json.loads(report_path.read_text())
    report_path.unlink()
    report_path.with_suffix(".png").unlink()
    return {"budget": budget, "reserved_cores": reserved, **report}


def run_label(run: dict, runs: list[dict]) -> str:
    reserved = f", {run['reserved_cores']} reserved" if len({r["reserved_cores"] for r in runs}) > 1 else ""
    return f"{run['budget']:,}{reserved}"


def table(runs: list[dict]) -> str:
    return harness.markdown_table(
        ["budget", "ITL median", "ITL p90", "ITL p99", "TTFT median", "TTFT p99", "TPOT median", "total tok/s",
         "duration"],
        [[run_label(r, runs), f"{r['itl_s']['median']:.3f} s", f"{r['itl_s']['p90']:.2f} s",
          f"{r['itl_s']['p99']:.1f} s", f"{r['ttft_s']['median']:.1f} s", f"{r['ttft_s']['p99']:.1f} s",
          f"{r['tpot_s']['median']:.3f} s", f"{r['total_tokens_per_s']:.0f}", f"{r['duration_s']:.0f} s"]
         for r in runs])


def chosen_budget(runs: list[dict]) -> dict:
    """The smallest budget whose p90 gap stays within 10% of the largest budget's and whose
    throughput stays within 5% of the best (the server's default comes from this)."""
    largest = max(runs, key=lambda r: r["budget"])
    best = max(r["total_tokens_per_s"] for r in runs)
    return min((r for r in runs if r["itl_s"]["p90"] <= 1.1 * largest["itl_s"]["p90"]
                and r["total_tokens_per_s"] >= 0.95 * best), key=lambda r: r["budget"])


def markdown(report: dict) -> str:
    """step_budget.json (or reserved_cores.json, the same runs varying the reserved cores) as
    bench/README.md shows it: the runs, and for budgets the one the server's default comes from."""
    runs, first = report["runs"], report["runs"][0]
    chosen = "" if len({r["reserved_cores"] for r in runs}) > 1 else (
        f"\n\nThe smallest budget whose p90 gap stays within 10% of the largest's and whose throughput stays within "
        f"5% of the best: {chosen_budget(runs)['budget']:,}.")
    return (f"Measured {report['date'][:10]} on {first['machine']} ({first['model']}); each run is the load "
            "test's workload (in the JSON) against a server started for it:\n\n" + table(runs) + chosen)


def plot(runs: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figure, (itl, ttft, speed) = plt.subplots(1, 3, figsize=(14, 4.2))
    names, width = [run_label(r, runs) for r in runs], 0.27  # a budget's bars: median, p90, p99
    for axis, key, title in ((itl, "itl_s", "gap between a request's tokens"), (ttft, "ttft_s", "time to first token")):
        for i, stat in enumerate(("median", "p90", "p99")):
            bars = axis.bar([x + (i - 1) * width for x in range(len(runs))], [r[key][stat] for r in runs], width,
                            label=stat)
            axis.bar_label(bars, fmt="%.2g", fontsize=7)
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # plain numbers
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.set_ylim(top=axis.get_ylim()[1] * 4)  # room for the legend above the bars
        axis.set(title=title, ylabel="seconds (log)", xlabel="step budget (tokens)")
        axis.set_xticks(range(len(runs)), names)
        axis.legend(fontsize=8, ncol=3, loc="upper center")
        axis.grid(alpha=0.3, axis="y")
    bars = speed.bar(names, [r["total_tokens_per_s"] for r in runs], color="grey")
    speed.bar_label(bars, fmt="%.0f", fontsize=8)
    speed.set(title="throughput (prompt + output tokens)", ylabel="tokens / s", xlabel="step budget (tokens)")
    speed.grid(alpha=0.3, axis="y")
    first = runs[0]
    figure.suptitle(f"{first['model']}, {first['machine']}: the same load test under each step budget "
                    f"({first['config']['requests']} requests, prompts {first['config']['prompt_lengths']})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--reserved-cores", type=int, nargs="+", default=[None],
                        help="cores vLLM's worker leaves free (default: what engine_kwargs picks)")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_budget.json")
    args = parser.parse_args(argv)
    runs = []
    for budget, reserved in itertools.product(args.budgets, args.reserved_cores):
        print(f"step budget {budget}, reserved cores {reserved if reserved is not None else 'default'}: "
              "starting a server and the load test", flush=True)
        runs.append(run_config(budget, reserved, args.out.parent))
    harness.write_json({"date": harness.now(), "workload": WORKLOAD, "runs": runs}, args.out)
    plot(runs, args.out.with_suffix(".png"))
    print(table(runs))
    return 0

