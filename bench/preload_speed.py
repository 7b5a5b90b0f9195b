"""Do the libraries vLLM's CPU guide asks to preload (tcmalloc, Intel OpenMP) make either engine faster?

    .venv/bin/python bench/preload_speed.py            # both runs, then the comparison
    .venv/bin/python bench/preload_speed.py --table    # the comparison from the runs already made

Runs ``bench/speed.py --quick --dtype bfloat16`` (stock vLLM and the plugin side by side: 2k and
8k prompts, 2 repetitions, the batch of 8) twice, as separate processes since ``LD_PRELOAD`` is
read when a process starts: without preloads (``ROPE_EXTEND_PRELOAD=0``) and with what the
server preloads by default (:func:`rope_plugins.frontend.engine_args.preload_cpu_libraries`).
Each run writes ``bench/results/preload_runs/<variant>.json``; the comparison (each median with
preloads over the one without, per engine, length and measure) goes to
``bench/results/preload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as a script too

from bench import harness  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = RESULTS / "preload_runs"
VARIANTS = {"without": {"ROPE_EXTEND_PRELOAD": "0"}, "with": {"ROPE_EXTEND_PRELOAD": "1"}}


def run(variant: str) -> None:
    """bench/speed.py --quick in bfloat16, with or without the preloads, into RUNS/<variant>.json."""
    RUNS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **VARIANTS[variant]}
    env.pop("LD_PRELOAD", None)  # only what the variant adds
    command = [sys.executable, str(ROOT / "bench" / "speed.py"), "--quick", "--dtype", "bfloat16",
               "--out", str(RUNS / f"{variant}.json")]
    print(f"preload: {variant}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, env=env, check=True)


def comparison(without: dict, with_: dict) -> dict:
    """Each median with the preloads over the one without, per configuration, length and measure,
    and the batch of 8's throughput (tokens per second) the other way round (higher is better)."""
    ratios = {config: {length: {measure: with_["median"][config][length][measure] / value
                                for measure, value in by_measure.items()}
                       for length, by_measure in by_length.items()}
              for config, by_length in without["median"].items()}
    throughput = {name: with_["batch8"]["tokens_per_second"][name] / value
                  for name, value in without["batch8"]["tokens_per_second"].items()}
    return {"date": harness.now(), "machine": without["machine"],
            "dtype": without["dtype"], "runs": {"without": without["date"], "with": with_["date"]},
            "time_with_over_without": ratios, "batch8_throughput_with_over_without": throughput,
            "median": {"without": without["median"], "with": with_["median"]}}


def markdown(report: dict) -> str:
    lines = [f"Measured {report['runs']['with'][:10]} on {report['machine']} ({report['dtype']}, bench/speed.py "
             "--quick): each time with tcmalloc and Intel OpenMP preloaded over the time without (below 1: faster).",
             "", "| engine | length | prefill | time per output token |", "| --- | --- | --- | --- |"]
    for config, by_length in report["time_with_over_without"].items():
        lines += [f"| {config} | {int(length):,} | {r['prefill']:.2f} | {r['tpot']:.2f} |"
                  for length, r in by_length.items()]
    throughput = report["batch8_throughput_with_over_without"]
    lines += ["", "Batch of 8 (tokens per second, with over without): "
              + ", ".join(f"{name} {ratio:.2f}" for name, ratio in throughput.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="compare the runs already in bench/results/preload_runs")
    args = parser.parse_args(argv)
    if not args.table:
        for variant in VARIANTS:
            run(variant)
    runs = {variant: json.loads((RUNS / f"{variant}.json").read_text()) for variant in VARIANTS}
    report = comparison(runs["without"], runs["with"])
    harness.write_json(report, RESULTS / "preload.json")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
