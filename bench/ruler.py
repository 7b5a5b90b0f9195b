"""RULER (Hsieh et al., 2024) through EleutherAI's lm-eval against this server: every extension
setting at 4k to 32k tokens, on SmolLM2-135M (trained at 8,192) and Qwen2.5-Coder-0.5B at a
pretend training length of 4,096.

    .venv/bin/python -m bench ruler --model smollm2-135m    # resumable; --budget-minutes N
    .venv/bin/python -m bench ruler --table --readme        # ruler.json/.png and its README block

One lm-eval run (``local-completions``, ``--limit`` samples) per model, length, task
(:data:`TASKS`, those built offline) and setting (:data:`SETTINGS`, with log-n past training,
and ``auto``); a setting that scored 0 everywhere at one length skips the longer ones
(``--after-zero``). Per-sample scores land in bench/results/ruler_runs.jsonl. The summary: each
score with its 95% Wilson interval, and the effective length, the longest whose score stays at
or above 85.6% of the model's own 4k score (RULER's bar, Llama-2-7B's 4k score, scaled).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

RESULTS = harness.RESULTS
STEM = "ruler"
TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]
LEFT_OUT = {"niah_single_2": "essays", "niah_single_3": "essays", "niah_multikey_1": "essays",
            "niah_multivalue": "essays", "niah_multiquery": "essays", "ruler_qa_squad": "SQuAD",
            "ruler_qa_hotpot": "HotpotQA"}
LENGTHS = [4096, 8192, 16384, 32768]
# the model's short name (rope_plugins/models/catalog.py): the training length its requests name (None: its own)
MODELS = {"smollm2-135m": None, "qwen2.5-coder-0.5b": 4096}
SETTINGS = [{"method": "none"}, {"method": "rerope"}, {"method": "leaky_rerope"}, {"method": "self_extend"},
            {"method": "yarn", "factor": "auto"}, {"method": "dual_chunk"}, {"method": "string"}]
THRESHOLD = 0.856  # RULER's: Llama-2-7B's 4k score, as a share of the model's own 4k score here
Z95 = 1.959964
GENERATED_TOKENS = 128  # RULER's longest answer (niah's max_gen_toks)


def label(setting: dict) -> str:
    fields = ", ".join(f"{k}={v}" for k, v in setting.items() if k != "method")
    return setting["method"] + (f"({fields})" if fields else "")


def plan(model: str, own_train_length: int, lengths: list[int], tasks: list[str]) -> list[dict]:
    """Every run of one model, shortest first: every setting, again with log-n past the (pretend)
    training length, and auto; each over ``tasks`` (one lm-eval run: its start is paid once for them all)."""
    pretend = MODELS.get(model)
    jobs = []
    for length in lengths:
        past = [{**s, "log_n": True} for s in SETTINGS] if length > (pretend or own_train_length) else []
        for setting in [*SETTINGS, *past, {"method": "auto"}]:
            plain = {k: v for k, v in setting.items() if k != "log_n"}
            jobs.append({"model": model, "tasks": tasks, "length": length,
                         "settings": {**setting, **({"train_length": pretend} if pretend else {})},
                         "label": label(setting), "without_log_n": label(plain)})
    return jobs


def chosen(jobs: list[dict], settings: list[str] | None) -> list[dict]:
    """The jobs of the settings labelled ``settings`` (all, for None); an unknown label is an error."""
    labels = list(dict.fromkeys(job["label"] for job in jobs))
    if unknown := sorted(set(settings or labels) - set(labels)):
        raise SystemExit(f"--settings: no setting labelled {', '.join(unknown)} at these lengths; "
                         f"the labels: {', '.join(labels)}")
    return [job for job in jobs if job["label"] in (settings or labels)]


def records(runs: Path) -> list[dict]:
    """Each task's run, from the log's records (one per lm-eval run, each over its tasks)."""
    logged = harness.read_log(runs)
    return [{**{k: v for k, v in record.items() if k not in ("tasks", "scores")}, "task": task, "scores": scores,
             "n": len(scores), "score": statistics.fmean(scores), "seconds": record["seconds"] / len(record["scores"])}
            for record in logged for task, scores in record["scores"].items()]


def still_to_do(jobs: list[dict], log: list[dict], samples: int) -> list[dict]:
    """The jobs with a task ``log`` (:func:`records`) holds no run of with at least ``samples`` samples,
    each with those tasks."""
    done = {(r["model"], r["length"], r["label"], r["task"]) for r in log if r["n"] >= samples}
    left = [{**job, "tasks": [t for t in job["tasks"] if (job["model"], job["length"], job["label"], t) not in done]}
            for job in jobs]
    return [job for job in left if job["tasks"]]


def after_a_zero(jobs: list[dict], log: list[dict]) -> tuple[list[dict], list[dict]]:
    """The jobs to run, and those left out because their setting scored 0 on every one of their tasks
    at a shorter length of the same model (``log``: :func:`records`): past training a score falls with
    the length, so a setting that found nothing at 16k is not given 33 minutes to find nothing at 32k."""
    zero = {(r["model"], r["task"], r["label"], r["length"]) for r in log if r["score"] == 0}
    kept, skipped = [], []
    for job in jobs:
        failed = all(any((job["model"], task, job["label"], shorter) in zero
                         for shorter in LENGTHS if shorter < job["length"]) for task in job["tasks"])
        (skipped if failed else kept).append(job)
    return kept, skipped


def expected_seconds(job: dict, log: list[dict], samples: int) -> float:
    """A job's time from the log's runs at its model and length (per task and sample), else a guess
    that grows a little faster than the length."""
    seen = [r["seconds"] / r["n"] for r in log if (r["model"], r["length"]) == (job["model"], job["length"])]
    per_sample = statistics.median(seen) if seen else 8.0 * (job["length"] / 4096) ** 1.5
    return per_sample * samples * len(job["tasks"])


def measure(args: argparse.Namespace, jobs: list[dict], work: list[float]) -> None:
    """The model's jobs (``work``: each one's expected seconds), each one lm-eval run against ``--url``
    or a server started for them, its per-sample scores appended to the log as it ends."""
    from rope_plugins.models.provision import provision
    from rope_plugins.testing.lm_eval_runs import run_lm_eval

    flags = ["--model", args.model, "--max-model-len", str(max(job["length"] for job in jobs) + 2 * GENERATED_TOKENS),
             "--kv-cache-memory", str(3 << 30), "--max-num-seqs", "2", "--log-level", "warning"]
    api_key = os.environ.get("ROPE_EXTEND_API_KEY")
    with harness.server_at(args.url, flags, args.out_dir / f"{STEM}_server.log") as base:
        tokenizer, served = provision(args.model), harness.served_model(base, api_key)

        def run(job: dict) -> None:
            length, began = job["length"], time.perf_counter()
            model_args = {"model": served, "base_url": f"{base}/v1/completions", "tokenizer": tokenizer,
                          "tokenizer_backend": "huggingface", "num_concurrent": 1,
                          "max_length": length + GENERATED_TOKENS, "timeout": 7200}
            with tempfile.TemporaryDirectory(prefix="ruler_lm_eval_") as scratch:  # lm-eval's own outputs
                result = run_lm_eval("local-completions", model_args, job["tasks"], Path(scratch), api_key=api_key,
                                     timeout=6 * 3600, limit=args.samples,
                                     gen_kwargs={"context_extension": job["settings"]},
                                     metadata={"max_seq_lengths": [length], "pretrained": str(tokenizer)})
            scores = {task: [float(sample[str(length)]) for sample in found["samples"]]
                      for task, found in result["tasks"].items()}
            harness.append_log(args.runs, {**{k: v for k, v in job.items() if k != "tasks"}, "scores": scores,
                                           "seconds": round(time.perf_counter() - began, 1), "date": harness.now()})

        harness.run_grid(jobs, work, run, lambda job: f"{job['label']} {job['length']}", f"RULER {args.model}",
                         args.budget_minutes)


def wilson(mean: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a share ``mean`` over ``n`` samples."""
    if n == 0:
        return 0.0, 1.0
    centre = (mean + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(mean * (1 - mean) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return max(0.0, min(mean, centre - half)), min(1.0, max(mean, centre + half))  # exact at 0 and 1


def cell(runs: list[dict]) -> dict:
    """One (setting, length) of a model over its tasks: the mean of the task scores, over every sample."""
    scores = [score for run in runs for score in run["scores"]]
    mean = statistics.fmean(run["score"] for run in runs)
    low, high = wilson(mean, len(scores))
    return {"score": round(mean, 4), "low": round(low, 4), "high": round(high, 4), "samples": len(scores),
            "tasks": {run["task"]: round(run["score"], 4) for run in runs}}


def effective_length(scores: dict[int, float], own_4k: float) -> int:
    """The longest length up to which every score stays at or above THRESHOLD x the model's own 4k score."""
    held = list(itertools.takewhile(lambda length: scores[length] >= THRESHOLD * own_4k, sorted(scores)))
    return held[-1] if held else 0


def summarize_model(runs: list[dict], tasks: list[str]) -> dict:
    """One model's cells (a setting at a length, over the tasks run for all of it), its own 4k score
    (plain RoPE, inside training for both models) and each setting's effective length."""
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        by_cell.setdefault((run["label"], run["length"]), []).append(run)
    cells = {f"{name} @ {length}": {"setting": name, "length": length, **cell(found)}
             for (name, length), found in by_cell.items() if {r["task"] for r in found} >= set(tasks)}
    own = cells.get("none @ 4096", {}).get("score")
    for c in cells.values():
        c["of_own_4k"] = round(c["score"] / own, 3) if own else None
    without_log_n = {run["label"]: run["without_log_n"] for run in runs}
    order = {name: rank for rank, name in enumerate([*map(label, SETTINGS), "auto"])}  # any other last
    settings = sorted(without_log_n, key=lambda name: (order.get(without_log_n[name], len(order)),
                                                       name != without_log_n[name], name))
    # inside training a log-n row is its row without log-n (not run twice): below the first length of any log-n row
    past_training = min((c["length"] for c in cells.values() if c["setting"] != without_log_n[c["setting"]]),
                        default=math.inf)
    longest = max((c["length"] for c in cells.values()), default=0)
    effective, at_least = {}, []
    for name in settings:
        scores = {c["length"]: c["score"] for c in cells.values()
                  if c["setting"] == without_log_n[name] and c["length"] < past_training}
        scores |= {c["length"]: c["score"] for c in cells.values() if c["setting"] == name}
        effective[name] = effective_length(scores, own) if own and min(scores, default=None) == 4096 else None
        if effective[name] and effective[name] == max(scores) < longest:  # held at every length run so far
            at_least.append(name)
    return {"own_4k": own, "settings": settings, "cells": cells, "effective_length": effective,
            "effective_at_least": at_least}


def summarize(log: list[dict], tasks: list[str], meta: dict) -> dict:
    models = sorted({r["model"] for r in log}, key=list(MODELS).index)
    return {**meta, "date": max(r["date"] for r in log), "tasks": tasks, "left_out": LEFT_OUT,
            "threshold": THRESHOLD, "measured_hours": round(sum(r["seconds"] for r in log) / 3600, 2),
            "samples_per_run": sorted({r["n"] for r in log}),
            "models": {model: summarize_model([r for r in log if r["model"] == model], tasks) for model in models}}


def model_table(name: str, model: dict, lengths: list[int]) -> str:
    """One model's settings x lengths: each score (the mean over the tasks) and its interval, and the
    effective length."""
    rows = []
    for setting in model["settings"]:
        cells, zero_at = [], None
        for length in lengths:
            c = model["cells"].get(f"{setting} @ {length}")
            after_zero = f"not run: 0 at {zero_at // 1024}k" if zero_at else ""
            cells.append(f"{c['score']:.2f} [{c['low']:.2f}, {c['high']:.2f}]" if c else after_zero)
            zero_at = zero_at or (length if c and c["score"] == 0 else None)
        effective = model["effective_length"].get(setting)
        shown = "" if effective is None else f"{effective // 1024}k" if effective else f"below {lengths[0] // 1024}k"
        rows.append([setting, *cells, f"at least {shown}" if setting in model["effective_at_least"] else shown])
    own = "" if model["own_4k"] is None else f" (its own 4k score, plain RoPE: {model['own_4k']:.3f})"
    return f"**{name}**{own}\n\n" + harness.markdown_table(
        ["setting", *(f"{length // 1024}k" for length in lengths), "effective length"], rows)


def markdown(report: dict) -> str:
    """ruler.json as bench/README.md shows it."""
    head = (f"Measured on {report['machine']}, {report['measured_hours']:.1f} h of runs, tasks "
            f"{', '.join(report['tasks'])}: the mean score [95% Wilson interval, "
            f"{'/'.join(map(str, report['samples_per_run']))} samples a task]; blank: not measured. Effective "
            f"length: the longest scoring at least {report['threshold']:.1%} of the model's own 4k score.")
    tables = [model_table(name, model, report["lengths"]) for name, model in report["models"].items()]
    return "\n\n".join([head, *tables])


def plot(report: dict, path: Path) -> None:
    """One grid per model, settings by lengths, each measured cell coloured and labelled by its score
    (lines would hide each other: most settings score the same)."""
    plt = harness.pyplot()
    import numpy as np

    models = report["models"]
    tallest = max(len(model["settings"]) for model in models.values())
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 1.2 + 0.4 * tallest), squeeze=False)
    for axis, (name, model) in zip(axes[0], models.items()):
        lengths = sorted({c["length"] for c in model["cells"].values()})
        grid = np.full((len(model["settings"]), len(lengths)), np.nan)
        for cell in model["cells"].values():
            grid[model["settings"].index(cell["setting"]), lengths.index(cell["length"])] = cell["score"]
        axis.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for (row, column), score in np.ndenumerate(grid):
            if not np.isnan(score):
                axis.text(column, row, f"{score:.2f}", ha="center", va="center", fontsize=8)
        axis.set_xticks(range(len(lengths)), [f"{length // 1024}k" for length in lengths])
        axis.set_yticks(range(len(model["settings"])), model["settings"], fontsize=8)
        axis.set(xlabel="tokens (blank: not run yet, or after a 0)", title=f"{name}: RULER score, mean over tasks")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(args: argparse.Namespace) -> int:
    log = records(args.runs)
    if not log:
        print(f"no runs in {args.runs}: nothing measured yet", file=sys.stderr)
        return 1
    # a table of what the log holds unless told which tasks and lengths: each cell needs all its tasks
    tasks = args.tasks or [task for task in TASKS if task in {r["task"] for r in log}]
    lengths = args.lengths or sorted({r["length"] for r in log})
    summary = summarize(log, tasks, {"machine": harness.machine(), "lengths": lengths})
    harness.write_json(summary, args.out_dir / f"{STEM}.json")
    plot(summary, args.out_dir / f"{STEM}.png")
    text = markdown(summary)
    print(text)
    if args.readme:
        from bench.readme import write_block

        write_block(STEM, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=next(iter(MODELS)), choices=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", help=f"default: {LENGTHS} (--table: those in the log)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, help="default: all six (--table: those in the log)")
    parser.add_argument("--samples", type=int, default=10, help="samples of each task at each length and setting")
    parser.add_argument("--settings", nargs="+", metavar="LABEL", help="only these settings, by their labels in "
                        "the table (e.g. rerope 'rerope(log_n=True)' auto); default: every one")
    parser.add_argument("--after-zero", action="store_true",
                        help="also run a setting at lengths past one where it scored 0 on every task")
    parser.add_argument("--dry-run", action="store_true", help="list the runs left and their expected time, and stop")
    parser.add_argument("--budget-minutes", type=float, help="start no run that would end after this many minutes")
    parser.add_argument("--url", help="a running server of --model instead of starting one")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--runs", type=Path, help=f"the runs log (default <out-dir>/{STEM}_runs.jsonl)")
    parser.add_argument("--table", action="store_true", help="the summary from the runs log, and stop")
    parser.add_argument("--readme", action="store_true", help="also rewrite the ruler.json block of bench/README.md")
    args = parser.parse_args(argv)
    args.runs = args.runs or args.out_dir / f"{STEM}_runs.jsonl"
    if not args.table:
        from transformers import AutoConfig

        from rope_plugins.models.provision import provision
        from rope_plugins.rules.checkpoint import declared_train_length

        own = declared_train_length(AutoConfig.from_pretrained(provision(args.model)))
        log = records(args.runs)
        jobs = still_to_do(chosen(plan(args.model, own, args.lengths or LENGTHS, args.tasks or TASKS), args.settings),
                           log, args.samples)
        if not args.after_zero:
            jobs, skipped = after_a_zero(jobs, log)
            for job in skipped:
                print(f"not run: {job['label']} at {job['length']} (0 at a shorter length; --after-zero runs it)",
                      file=sys.stderr)
        work = [expected_seconds(job, log, args.samples) for job in jobs]
        print(f"{len(jobs)} runs to do for {args.model} ({args.samples} samples each): about {sum(work) / 3600:.1f} h "
              "at the pace the log shows at each length", file=sys.stderr)
        if args.dry_run:
            for job, seconds in zip(jobs, work):
                print(f"  {job['label']} at {job['length']}: {', '.join(job['tasks'])} (about {seconds / 60:.0f} min)")
            return 0
        measure(args, jobs, work)
    return report(args)

