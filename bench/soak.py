"""Soak: the server at its default limits under a steady load of long prompts for a long time
(20 minutes by default), watching that nothing leaks and nothing fails.

    .venv/bin/python bench/soak.py                      # 20 minutes, writes bench/results/soak.{json,png}
    .venv/bin/python bench/soak.py --minutes 2 --out /tmp/soak.json

Starts ``python -m rope_plugins.server`` with ``make run``'s settings (only the log level lowered), runs
deploy/loadtest.py against it (prompts of 1k-16k tokens, past the 8k training length, four at
a time, a mix of methods) and samples the resident memory of the server and its engine
processes every few seconds. Reports the load test's figures (error rate, TTFT, the p99 gap
between tokens), the RSS over time and its growth over the second half of the run (after
warm-up: compiled graphs, allocator pools), and a PNG of both.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
WORKLOAD = ["--concurrency", "4", "--prompt-lengths", "1024,4096,8192,16384", "--output-tokens", "32",
            "--mix", "auto=1,rerope=1,leaky_rerope=1,ntk_mixed=1", "--requests", "100000"]


def tree_rss(pid: int) -> float:
    """Resident memory of a process and its descendants, in MiB."""
    import psutil

    total = 0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def sample_memory(pid: int, every: float, stop: threading.Event, began: float, samples: list[dict]) -> None:
    while not stop.wait(every):
        samples.append({"t_s": round(time.perf_counter() - began, 1), "rss_mib": round(tree_rss(pid), 1)})


def growth_mib_per_hour(samples: list[dict]) -> float:
    """Least-squares slope of RSS over the second half of the run."""
    half = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 2]
    if len(half) < 2:
        return 0.0
    mean_t = sum(s["t_s"] for s in half) / len(half)
    mean_m = sum(s["rss_mib"] for s in half) / len(half)
    slope = (sum((s["t_s"] - mean_t) * (s["rss_mib"] - mean_m) for s in half)
             / sum((s["t_s"] - mean_t) ** 2 for s in half))
    return slope * 3600


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rope_plugins.deploy import loadtest

    figure, (memory, gaps) = plt.subplots(1, 2, figsize=(11, 4.2))
    samples = report["rss"]
    memory.plot([s["t_s"] / 60 for s in samples], [s["rss_mib"] for s in samples])
    memory.set(xlabel="minutes", ylabel="MiB", title=f"RSS, server + engine ({report['rss_growth_mib_per_hour']:+.0f} "
                                                      "MiB/h over the second half)")
    loadtest.draw_tpot(gaps, report["load"]["requests"])
    gaps.set_title(f"time per output token (ITL p99 {report['load']['itl_s']['p99'] * 1000:.0f} ms)")
    gaps.legend(fontsize=8)
    for axis in (memory, gaps):
        axis.grid(alpha=0.3)
    load = report["load"]
    figure.suptitle(f"soak: {report['minutes']:.0f} min, {load['completed']} done, {load['failed']} failed "
                    f"(error rate {load['error_rate']:.1%}), {load['machine']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    """soak.json as bench/README.md shows it."""
    load, c = report["load"], report["load"]["config"]
    ttft, itl = load["ttft_s"], load["itl_s"]
    rows = [("requests done / failed", f"{load['completed']} / {load['failed']} (error rate {load['error_rate']:.1%}) "
                                       f"in {report['minutes']:.0f} min"),
            ("RSS, server + engine", f"{report['rss_start_mib']:.0f} MiB at the start, "
                                     f"{report['rss_peak_mib']:.0f} peak, {report['rss_end_mib']:.0f} at the end"),
            ("RSS trend, second half", f"{report['rss_growth_mib_per_hour']:+.0f} MiB/h"),
            ("time to first token", f"median {ttft['median']:.0f} s, p99 {ttft['p99']:.0f} s"),
            ("gap between tokens", f"median {itl['median']:.2f} s, p90 {itl['p90']:.1f} s, p99 {itl['p99']:.1f} s"),
            ("server alive at the end", "yes" if report["server_alive_at_end"] else "no")]
    lengths = ", ".join(f"{n:,}" for n in c["prompt_lengths"])
    return (f"Measured {report['date'][:10]} on {load['machine']} ({load['model']}, {report['server_flags']}): "
            f"prompts of {lengths} tokens, {c['concurrency']} at a time, mix `{c['mix']}`, {c['output_tokens']} "
            "output tokens each:\n\n| measured | value |\n| --- | --- |\n"
            + "\n".join(f"| {name} | {value} |" for name, value in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from rope_plugins.deploy import loadtest
    from rope_plugins.testing.launcher import running_server

    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_path = args.out.with_name(args.out.stem + "_load.json")
    samples: list[dict] = []
    stop = threading.Event()
    with running_server(["--log-level", "warning"], args.out.with_name(args.out.stem + "_server.log")) as server:
        began = time.perf_counter()
        samples.append({"t_s": 0.0, "rss_mib": round(tree_rss(server.process.pid), 1)})
        sampler = threading.Thread(target=sample_memory, args=(server.process.pid, args.sample_seconds, stop, began,
                                                                samples), daemon=True)
        sampler.start()
        try:
            loadtest.main(["--url", server.base, *WORKLOAD, "--duration", str(args.minutes * 60),
                           "--out", str(load_path)])
        finally:
            stop.set()
            sampler.join()
        healthy_after = server.process.poll() is None
    load = json.loads(load_path.read_text())
    load_path.unlink()
    load_path.with_suffix(".png").unlink()
    report = {"date": load["date"], "minutes": (time.perf_counter() - began) / 60, "workload": WORKLOAD,
              "server_flags": "make run's defaults, --log-level warning", "server_alive_at_end": healthy_after,
              "rss_start_mib": samples[0]["rss_mib"], "rss_peak_mib": max(s["rss_mib"] for s in samples),
              "rss_end_mib": samples[-1]["rss_mib"], "rss_growth_mib_per_hour": round(growth_mib_per_hour(samples), 1),
              "rss": samples, "load": load}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(loadtest.summary(load))
    print(f"RSS {report['rss_start_mib']:.0f} -> {report['rss_end_mib']:.0f} MiB (peak {report['rss_peak_mib']:.0f}), "
          f"{report['rss_growth_mib_per_hour']:+.1f} MiB/h over the second half")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if load["completed"] and not load["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
