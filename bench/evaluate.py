"""Long-context quality of every method on the real default model, through the real server.

    .venv/bin/python bench/evaluate.py            # the full grid (resumable)
    .venv/bin/python bench/evaluate.py --quick    # 9k tokens, the methods' loss and accuracy
    .venv/bin/python bench/evaluate.py --table    # summary files and bench/README.md's tables from the results log

Starts ``python -m rope_plugins.server`` on SmolLM2-135M-Instruct (trained at 8,192 tokens) and, over HTTP
with the openai client, for each method (none, pi, ntk_old, ntk_fixed, ntk_mixed, yarn,
rerope, leaky_rerope, self_extend, ntk_dynamic, string, dual_chunk; each with and without log_n; the frequency
methods also with ``factor: "auto"``; and the server's ``auto``) and context length:

* **loss**: mean next-token negative log-likelihood over the last 4,096 tokens of a text
  of that length (``echo`` + ``logprobs`` on /v1/completions score the prompt); every
  length's text ends at the same token (32,768 into the corpus), so every length scores the
  same tokens with more or less context before them;
* **non-repeat accuracy**: how often the true next token is the model's top-1 over those
  same tokens; **repeat accuracy**: the same over the second copy of a text repeated twice
  to fill the context (the seeds' repeat test: can the model copy from far back?);
* **passkey**: a 5-digit number hidden at several depths of filler text, asked for at the
  end (greedy, 8 tokens; found or not);
* ablations past the training length: the ReRoPE and Leaky ReRoPE windows (1/8, 1/4, 1/2
  of training), Self-Extend's group (4, 8, 16), ntk_mixed's beta; and the search for
  ``auto``'s setting (:data:`AUTO_CANDIDATES`, at every length past training).

``factor: "auto"`` is measured where it is not the fixed factor: at 32k it resolves to 4, the
fixed rows' setting (:func:`is_the_fixed_factor`), and those rows stand for it.

The text is CPython's own documentation (``--corpus`` swaps it: ``stdlib`` or any text
file/directory). Each measurement is appended to ``bench/results/eval_runs.jsonl`` as it
finishes and skipped when found there, so a long run can be stopped and resumed; the summary
goes to ``eval.json``, ``eval.csv`` and ``eval.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rope_plugins.rules.settings import AUTO, ExtensionSettings, length_factor, positions_used

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as a script too

from bench import harness  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
METHODS = ["none", "pi", "ntk_old", "ntk_fixed", "ntk_mixed", "yarn", "rerope", "leaky_rerope", "self_extend",
           "ntk_dynamic", "string", "dual_chunk", "auto"]
# the methods with a factor: each is measured at its fixed default and sized to the request (factor "auto")
SIZED_METHODS = ["pi", "ntk_old", "ntk_fixed", "ntk_mixed", "yarn"]
TRAIN_LENGTH = 8192
QUICK_LENGTH = 9216  # --quick: one length past training, loss and accuracy only
SCORED_TOKENS = 4096
# Every length's loss text ends at the same token, so all lengths score the same 4,096 tokens
# and differ only in how much context precedes them: a loss that rises with length is the
# method failing, not a harder passage.
LOSS_TEXT_END = 32768
TESTS = ["loss", "repeat", "passkey"]
PASSKEY_ANSWER_TOKENS = 8
SCORING_ANSWER_TOKENS = 1  # loss and repeat score the prompt (echo) and generate one token
# the frequency methods' factor when a request names none
FIXED_FACTOR = ExtensionSettings.model_fields["factor"].default
# the classic passkey haystack: the 135M model does not find a needle in real documentation
# text even within its training length
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def configs(methods: list[str], log_n_too: bool) -> list[dict]:
    """Each method at its defaults, the frequency methods also with ``factor: "auto"``; with
    ``log_n_too`` each of those again with log_n (but ``auto``, which decides log_n itself)."""
    grid = [{"method": m} for m in methods]
    grid += [{"method": m, "factor": "auto"} for m in methods if m in SIZED_METHODS]
    if log_n_too:
        grid += [{**s, "log_n": True} for s in grid if s["method"] != "auto"]
    return grid


# the ablated setting of each method and its default (rope_plugins/rules/settings.py)
ABLATED = {"rerope": ("window", TRAIN_LENGTH // 4), "leaky_rerope": ("window", TRAIN_LENGTH // 4),
           "self_extend": ("group", 8), "ntk_mixed": ("beta", 0.625)}


def ablations() -> list[dict]:
    windows = [{"method": m, "window": TRAIN_LENGTH // k} for m in ("rerope", "leaky_rerope")
               for k in (8, 2)]  # beside the default 1/4
    groups = [{"method": "self_extend", "group": g} for g in (4, 16)]  # beside the default 8
    betas = [{"method": "ntk_mixed", "beta": b} for b in (0.5, 0.75, 1.0)]
    return windows + groups + betas


# Settings tried for `auto` past the training length (server/auto.py's rule comes from these),
# each at 16k and 32k: wider windows than the default quarter, with log_n, which lowered
# ReRoPE's and Leaky ReRoPE's loss at 32k in the main grid.
AUTO_CANDIDATES = [
    {"method": "rerope", "window": TRAIN_LENGTH // 2, "log_n": True},
    {"method": "rerope", "window": TRAIN_LENGTH * 3 // 4, "log_n": True},
    {"method": "leaky_rerope", "window": TRAIN_LENGTH // 2, "log_n": True},
    {"method": "leaky_rerope", "window": TRAIN_LENGTH * 3 // 4, "log_n": True},
    {"method": "self_extend", "window": TRAIN_LENGTH // 2, "group": 8, "log_n": True},
    {"method": "self_extend", "window": TRAIN_LENGTH // 2, "group": 8},
    {"method": "self_extend", "window": TRAIN_LENGTH // 4, "group": 16, "log_n": True},
    # the window and group pairs that keep the far positions inside training at 16k or 32k
    # (⌊m/g⌋ + w - ⌊w/g⌋ < L): a smaller group at 16k, a wider window at either
    {"method": "self_extend", "window": TRAIN_LENGTH // 2, "group": 4},
    {"method": "self_extend", "window": TRAIN_LENGTH * 3 // 4, "group": 8},
    {"method": "self_extend", "window": TRAIN_LENGTH * 3 // 4, "group": 16},
    {"method": "self_extend", "window": TRAIN_LENGTH * 7 // 8, "group": 32},
    # dual-chunk attention's chunks as long as training (ChunkLlama's 3/4 is the method's own row),
    # with log-n and without, and with a local window twice its default 1/16
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH, "log_n": True},
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH},
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH, "local_window": TRAIN_LENGTH // 8, "log_n": True},
]


# Self-Extend loses the passkeys (auto's own row): the candidates whose retrieval is measured
# too, for the trade-off between the loss and finding a fact far back
RETRIEVAL_CANDIDATES = [{"method": "leaky_rerope", "window": TRAIN_LENGTH // 2, "log_n": True},
                        # the one Self-Extend candidate within the target at 32k whose retrieval was unmeasured
                        {"method": "self_extend", "window": TRAIN_LENGTH // 2, "group": 8}]


def is_candidate(settings: dict) -> bool:
    return settings in AUTO_CANDIDATES


def is_the_fixed_factor(job: tuple) -> bool:
    """Whether a ``factor: "auto"`` job's request resolves to its method's fixed factor, to 1%:
    at 32k, four times the training length, a loss or repeat request spans exactly factor 4's
    positions (the same computation as the fixed row's) and a passkey's answer tokens move it by
    0.1%. Those rows would measure the fixed rows again; they are not planned."""
    test, settings, length = job[:3]
    if settings.get("factor") != AUTO:
        return False
    answer = PASSKEY_ANSWER_TOKENS if test == "passkey" else SCORING_ANSWER_TOKENS
    resolved = length_factor(positions_used(length, answer), TRAIN_LENGTH)
    return abs(resolved / FIXED_FACTOR - 1) <= 0.01


def plan(lengths: list[int], grid: list[dict], depths: list[float], keys: int,
         with_ablations: bool = True) -> list[tuple]:
    """The measurements in the order they run: the most informative per CPU-hour first, so a
    run stopped early (the full grid takes long) has whole curves rather than
    every test of a few lengths.

    The search for ``auto``'s setting past training first (its losses at every length past
    training); up to the first length past training: every loss and the ablations; then repeat and
    passkey within training; the longer lengths' losses (without log_n, then with it); repeat
    and passkey at the first length past training; the rest. log_n multiplies queries by
    max(1, log n / log train): the identity up to the training length, where only its loss is
    measured (a check that it equals the plain row). Passkey depths go deepest first: the
    filler before a needle is the same tokens at every depth, so later trials reuse the
    earlier ones' K/V through the prefix cache.
    """
    first_past = next((n for n in lengths if n > TRAIN_LENGTH), max(lengths))
    short = [n for n in lengths if n <= first_past]
    within = [n for n in lengths if n <= TRAIN_LENGTH]
    past = [n for n in short if n > TRAIN_LENGTH]
    long = [n for n in lengths if n > first_past]
    plain = [s for s in grid if not s.get("log_n")]
    # a factor sized to the request is 1 within training: its rows there are the plain method's,
    # so (as log_n's) only their loss is measured, as a check
    unsized = [s for s in plain if s.get("factor") != "auto"]
    scaled = [s for s in grid if s.get("log_n")]

    def losses(group, settings_list):
        return [("loss", s, n) for n in group for s in settings_list]

    def details(group, settings_list):
        jobs = []
        for n in group:
            jobs += [("repeat", s, n) for s in settings_list]
            jobs += [("passkey", s, n, depth, round(depth * 100) * 100 + k)
                     for s in settings_list for depth in sorted(depths, reverse=True) for k in range(keys)]
        return jobs

    ablation = [] if not (past and with_ablations) else [("loss", s, first_past) for s in ablations()]
    search = [] if not (past and with_ablations) else (losses(past + long, AUTO_CANDIDATES)
                                                       + details(past + long, RETRIEVAL_CANDIDATES))
    jobs = (search + losses(short, grid) + ablation + details(within, unsized) + losses(long, plain)
            + losses(long, scaled) + details(past, plain) + details(past, scaled) + details(long, plain)
            + details(long, scaled))
    return [job for job in jobs if not is_the_fixed_factor(job)]


def job_key(job: tuple) -> tuple:
    """(test, label, length, sample): a planned measurement's identity in the results log."""
    return job[0], label(job[1]), job[2], job[4] if job[0] == "passkey" else 0


def record_key(record: dict) -> tuple:
    return record["test"], record["label"], record["length"], record.get("sample", 0)


def cost_key(job_or_record) -> tuple:
    """What a measurement's time depends on: the test, the length and, for a passkey, the
    trial's place in its depth order (a trial after another at the same depth reuses that
    one's filler prefix through the prefix cache and takes a fraction of the time)."""
    if isinstance(job_or_record, dict):
        return job_or_record["test"], job_or_record["length"], job_or_record.get("sample", 0)
    return job_or_record[0], job_or_record[2], job_key(job_or_record)[3]


def estimated_seconds(jobs: list[tuple], records: list[dict]) -> list[float | None]:
    """Each job's expected time on this machine, from the results log: the median of the
    latest three of the same test, length and trial (the machine may have changed between
    runs; the latest are most like this one); for a length not measured yet, that test's time at
    the nearest shorter length scaled by how much the loss took longer between the two lengths
    (the loss is measured first everywhere); None where the log says nothing."""
    times: dict[tuple, list[float]] = {}
    for r in records:
        times.setdefault(cost_key(r), []).append(r["seconds"])
    median = {key: statistics.median(values[-3:]) for key, values in times.items()}
    loss_time = {length: t for (test, length, _), t in median.items() if test == "loss"}

    def estimate(job: tuple) -> float | None:
        test, length, sample = cost_key(job)
        if (test, length, sample) in median:
            return median[test, length, sample]
        shorter = [n for (t, n, s) in median if t == test and s == sample and n < length and n in loss_time]
        if shorter and length in loss_time:
            n = max(shorter)
            return median[test, n, sample] * loss_time[length] / loss_time[n]
        return loss_time.get(length)

    return [estimate(job) for job in jobs]


def fits_budget(expected: float, measured: float, estimated: float, left: float) -> bool:
    """Whether a measurement the log expects to take ``expected`` seconds fits in the ``left``
    seconds of the budget, with the log's estimates scaled by how this run compared with
    them so far (``measured`` seconds for work estimated at ``estimated``)."""
    pace = measured / estimated if estimated else 1.0
    return expected * pace <= left


def label(settings: dict) -> str:
    extra = ",".join(f"{k}={v}" for k, v in settings.items() if k != "method")
    return settings["method"] + (f"({extra})" if extra else "")


def loss_window(tokens: list[int], length: int) -> tuple[list[int], int]:
    """The loss's prompt at ``length``: the corpus' ``tokens`` ending at the same token for every
    length (LOSS_TEXT_END, or ``length`` past it), and how many of its last tokens are scored."""
    end = max(length, LOSS_TEXT_END)
    return tokens[end - length: end], min(SCORED_TOKENS, length - 1)


class Evaluator:
    def __init__(self, base: str, corpus: str, runs: Path, api_key: str | None = None):
        import httpx
        from openai import OpenAI

        from rope_plugins.deploy.corpus import load_corpus

        self.http = httpx.Client(base_url=base, timeout=7200,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.client = OpenAI(base_url=f"{base}/v1", api_key=api_key or "unused", max_retries=0, timeout=7200)
        self.model = self.http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        text = load_corpus(corpus)
        self.tokens = self.tokenize(text[: 400_000])
        self.filler = self.tokenize(FILLER * 4000)
        self.runs = runs
        self.split = tokenizer_split()

    def tokenize(self, text: str) -> list[int]:
        response = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        return response.raise_for_status().json()["tokens"]

    def run(self, job: tuple) -> dict:
        """Measures the job and appends its record to the results log."""
        key = job_key(job)
        test, settings, length, *passkey_at = job
        began = time.perf_counter()
        values = getattr(self, test)(settings, length, *passkey_at)
        record = {"test": test, "label": key[1], "settings": settings, "length": length, "sample": key[3],
                  **values, "tokenizer": self.split, "seconds": round(time.perf_counter() - began, 1),
                  "date": harness.now()}
        with self.runs.open("a") as out:
            out.write(json.dumps(record) + "\n")
        return record

    def complete(self, prompt: list[int], settings: dict, **fields) -> tuple[Any, dict]:
        """The completion and the settings the server applied (its x-context-extension header:
        what ``auto`` and ``factor: "auto"`` resolved to)."""
        raw = self.client.completions.with_raw_response.create(
            model=self.model, prompt=prompt, temperature=0, extra_body={"context_extension": settings}, **fields)
        return raw.parse(), json.loads(raw.headers["x-context-extension"])

    def score(self, prompt: list[int], settings: dict, scored: int) -> tuple[float, float, dict]:
        """Mean NLL and top-1 accuracy of the last ``scored`` prompt tokens, and the settings applied."""
        answer, applied = self.complete(prompt, settings, max_tokens=SCORING_ANSWER_TOKENS, echo=True,
                                        logprobs=1)
        logprobs = answer.choices[0].logprobs
        chosen = logprobs.token_logprobs[len(prompt) - scored: len(prompt)]
        tops = logprobs.top_logprobs[len(prompt) - scored: len(prompt)]
        nll = -statistics.fmean(chosen)
        accuracy = statistics.fmean(1.0 if lp >= max(top.values()) - 1e-6 else 0.0 for lp, top in zip(chosen, tops))
        return nll, accuracy, applied

    def loss(self, settings: dict, length: int) -> dict:
        prompt, scored = loss_window(self.tokens, length)
        nll, accuracy, applied = self.score(prompt, settings, scored)
        return {"nll": nll, "accuracy": accuracy, "text_end": max(length, LOSS_TEXT_END), "applied": applied}

    def repeat(self, settings: dict, length: int) -> dict:
        half = self.tokens[50_000: 50_000 + length // 2]  # another passage than the loss text
        _, accuracy, applied = self.score(half + half, settings, min(SCORED_TOKENS, len(half) - 1))
        return {"accuracy": accuracy, "applied": applied}

    def passkey(self, settings: dict, length: int, depth: float, sample: int) -> dict:
        key = str(random.Random(f"{length}-{depth}-{sample}").randrange(10_000, 100_000))
        needle = self.tokenize(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        question = self.tokenize(" What is the pass key? The pass key is")
        room = length - len(needle) - len(question)
        at = int(room * depth)
        prompt = self.filler[:at] + needle + self.filler[at:room] + question
        answer, applied = self.complete(prompt, settings, max_tokens=PASSKEY_ANSWER_TOKENS)
        text = answer.choices[0].text
        return {"found": key in text, "depth": depth, "answer": text, "applied": applied}


def is_current(record: dict) -> bool:
    """False for a loss scored on another text (an older definition of the loss text)."""
    return record["test"] != "loss" or record.get("text_end") == max(record["length"], LOSS_TEXT_END)


def current_records(runs: Path) -> list[dict]:
    return [r for r in map(json.loads, runs.read_text().splitlines()) if is_current(r)]


def summarize(records: list[dict]) -> dict:
    rows: dict[tuple, dict] = {}
    for r in records:
        row = rows.setdefault((r["label"], r["length"]), {"label": r["label"], "length": r["length"],
                                                           "settings": r["settings"], "passkey_trials": 0,
                                                           "passkey_found": 0})
        if r["test"] == "loss":
            row["nll"], row["accuracy"] = r["nll"], r["accuracy"]
        elif r["test"] == "repeat":
            row["repeat_accuracy"] = r["accuracy"]
        elif r["test"] == "passkey":
            row["passkey_trials"] += 1
            row["passkey_found"] += int(r["found"])
    for row in rows.values():
        trials = row["passkey_trials"]
        row["passkey"] = row["passkey_found"] / trials if trials else None
    return {"rows": sorted(rows.values(), key=lambda r: (r["label"], r["length"]))}


def write_outputs(report: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    harness.write_json(report, out_dir / f"{stem}.json")
    columns = ["label", "length", "nll", "accuracy", "repeat_accuracy", "passkey", "passkey_trials"]
    with (out_dir / f"{stem}.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(report["rows"])
    plot(report, out_dir / f"{stem}.png")


PANEL_HEIGHT = 4.4  # inches, a row of panels
PANELS = [("nll", "loss (NLL of the last 4k tokens)"), ("accuracy", "next-token accuracy, non-repeat"),
          ("repeat_accuracy", "next-token accuracy, repeat"), ("passkey", "passkey retrieval")]


def method_of(name: str) -> str:
    return name.split("(")[0]


def label_order(name: str) -> tuple:
    """Methods in the issue's order, each before its variants."""
    return METHODS.index(method_of(name)), name


def line_style(name: str) -> str:
    """Solid at the method's defaults, dashed with log_n, dotted with the factor sized to the
    request, dash-dotted with both."""
    return {(False, False): "-", (True, False): "--", (False, True): ":", (True, True): "-."}[
        "log_n" in name, "factor=auto" in name]


def is_ablation(row: dict) -> bool:
    """A setting varied away from its method's defaults (a factor sized to the request is a
    main row: it is what the method does by default with `--factor auto`)."""
    varied = set(row["settings"]) - {"method", "log_n"}
    return bool(varied - ({"factor"} if row["settings"].get("factor") == "auto" else set()))


def off_scale_limit(values: list[float]) -> float:
    """The top of a loss axis that keeps the close-together losses apart: a collapsed method
    (plain RoPE past training: 6-9 nats against 2.5) would otherwise flatten the rest."""
    middle, low = statistics.median(values), min(values)
    return min(max(values), middle + 4 * (middle - low))


def passkey_labels(rows: list[dict]) -> list[str]:
    """The settings with passkey trials, in the rows' order: the passkey grid's rows."""
    return list(dict.fromkeys(r["label"] for r in rows if r["passkey_trials"]))


def passkey_grid(axis, rows: list[dict], lengths: list[int]) -> None:
    """Found / trials per method and length as a coloured grid: lines of many methods at
    6/6 would hide one another."""
    names = passkey_labels(rows)
    by = {(r["label"], r["length"]): r for r in rows}
    share = [[by[name, n]["passkey"] if by.get((name, n), {}).get("passkey_trials") else math.nan for n in lengths]
             for name in names]
    axis.imshow(share, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, name in enumerate(names):
        for j, n in enumerate(lengths):
            row = by.get((name, n), {})
            if row.get("passkey_trials"):
                axis.text(j, i, f"{row['passkey_found']}/{row['passkey_trials']}", ha="center", va="center", fontsize=8)
    axis.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
    axis.set_yticks(range(len(names)), names, fontsize=8)
    axis.set_xlabel("context tokens")


def plot(summary: dict, path: Path) -> None:
    """One panel per measured quantity: lines over context length (solid plain, dashed
    log_n, one colour per method), bars when there is one length (--quick); the ablations'
    losses as bars beside their defaults; the legend in a panel of its own."""
    plt = harness.pyplot()

    rows = sorted(summary["rows"], key=lambda r: label_order(r["label"]))
    main = [r for r in rows if not is_ablation(r)]
    ablation_length = min((r["length"] for r in rows if is_ablation(r) and not is_candidate(r["settings"])),
                          default=None)
    compared = ablation_rows(rows, ablation_length)
    panels = [(key, title) for key, title in PANELS if any(r.get(key) is not None for r in main)]
    lengths = sorted({r["length"] for r in main})
    lines = len(lengths) > 1
    figure, axes = panel_grid(plt, panels, main, lines, bool(compared))
    colours = dict(zip(METHODS, plt.cm.tab20.colors[0::2] + plt.cm.tab20.colors[1::2]))
    for axis, (key, title) in zip(axes, panels):
        if not lines:
            shown = [r for r in main if r.get(key) is not None]
            draw_bars(axis, shown, key, [r["label"] for r in shown], colours)
            axis.set_title(f"{title}, {lengths[0]:,} tokens")
        elif key == "passkey":
            passkey_grid(axis, main, lengths)
            axis.set_title(title)
            continue
        else:
            draw_lines(axis, main, key, title, lengths, colours)
        axis.grid(alpha=0.3)
    used = len(panels)
    if compared:
        draw_ablations(axes[used], compared, ablation_length, colours)
        used += 1
    if lines:
        handles, names = axes[0].get_legend_handles_labels()
        axes[used].legend(handles, names, loc="center", ncol=2, fontsize=8,
                          title="method (dashed: with log_n; dotted: factor auto)")
    for axis in axes[used:]:
        axis.axis("off")
    figure.suptitle("SmolLM2-135M-Instruct (trained at 8,192 tokens): methods past the training length")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def panel_grid(plt, panels: list[tuple[str, str]], main: list[dict], lines: bool, ablations: bool) -> tuple:
    """The figure and its axes, row by row: the panels, the ablations' and the legend's (with
    lines), up to three a row; the passkey grid's row as tall as its methods need."""
    count = len(panels) + ablations + lines  # + the legend's panel
    columns = min(count, 3)
    heights = [PANEL_HEIGHT] * math.ceil(count / columns)
    passkey_panel = next((i for i, (key, _) in enumerate(panels) if key == "passkey"), None)
    if lines and passkey_panel is not None:  # the grid's row grows so each method's label has room
        heights[passkey_panel // columns] = max(PANEL_HEIGHT, 0.2 * len(passkey_labels(main)) + 1.6)
    figure, axes = plt.subplots(len(heights), columns, figsize=(5.5 * columns, sum(heights)), squeeze=False,
                                gridspec_kw={"height_ratios": heights})
    return figure, list(axes.flat)


def draw_bars(axis, shown: list[dict], key: str, names: list[str], colours: dict) -> None:
    drawn = axis.bar(range(len(shown)), [r[key] for r in shown],
                     color=[colours[method_of(r["label"])] for r in shown])
    axis.bar_label(drawn, fmt="%.3f", fontsize=7, rotation=90, padding=2)  # neighbours differ in the second decimal
    axis.set_xticks(range(len(shown)), names, rotation=40, ha="right", fontsize=8)


def draw_lines(axis, main: list[dict], key: str, title: str, lengths: list[int], colours: dict) -> None:
    """``key`` over context length, a line per setting; a loss panel's top cut where the
    collapsed methods would flatten the rest, their values written at the edge."""
    top = off_scale_limit([r[key] for r in main if r.get(key) is not None]) if key == "nll" else math.inf
    off_scale: dict[int, dict[str, str]] = {}  # length -> value written -> method (once per value)
    for name in dict.fromkeys(r["label"] for r in main):
        points = sorted((r["length"], r[key]) for r in main if r["label"] == name and r.get(key) is not None)
        if not points:
            continue
        axis.plot(*zip(*[(n, min(v, top)) for n, v in points]), marker="o", color=colours[method_of(name)],
                  label=name, linestyle=line_style(name))
        for n, v in points:
            if v > top:  # drawn at the edge, the values listed under it
                off_scale.setdefault(n, {}).setdefault(f"{v:.2f}", method_of(name))
    for n, values in off_scale.items():
        axis.annotate("\n".join(f"{method} {v}" for v, method in values.items()), (n, top), ha="center",
                      va="top", textcoords="offset points", xytext=(0, -8), fontsize=7)
    if top < math.inf:
        axis.set_ylim(top=top * 1.01)
        axis.set_title(f"{title}\n(values above {top:.2f} at the top edge)", fontsize=10)
    else:
        axis.set_title(title)
    axis.axvline(TRAIN_LENGTH, color="grey", linestyle=":")
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    axis.set_xlabel("context tokens (dotted: training length)")


def draw_ablations(axis, compared: list[dict], length: int, colours: dict) -> None:
    """The ablations' losses at ``length`` as bars beside their methods' defaults."""
    draw_bars(axis, compared, "nll", [r["label"] if is_ablation(r) else ablation_default(r["label"]) + " (default)"
                                      for r in compared], colours)
    bottom = math.floor(min(r["nll"] for r in compared) * 10) / 10 - 0.1  # from 0, differences of 0.01 vanish
    axis.set_ylim(bottom=bottom, top=max(r["nll"] for r in compared) + 0.1)
    axis.set_title(f"ablations: loss at {length:,} tokens (axis from {bottom:.1f})")
    axis.grid(alpha=0.3)


def markdown_table(summary: dict) -> str:
    def cell(value, fmt="{:.3f}"):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)

    main = [r for r in summary["rows"] if not is_ablation(r)]
    lengths = sorted({r["length"] for r in main})
    labels = sorted({r["label"] for r in main}, key=label_order)
    by = {(r["label"], r["length"]): r for r in summary["rows"]}
    out = []
    for key, title, fmt in (("nll", "Loss (mean NLL of the last 4,096 tokens; lower is better)", "{:.3f}"),
                            ("accuracy", "Next-token accuracy, non-repeated text", "{:.3f}"),
                            ("repeat_accuracy", "Next-token accuracy, repeated text (second copy)", "{:.3f}"),
                            ("passkey", "Passkey retrieval (found / trials)", None)):
        table = []
        for name in labels:
            cells = []
            for n in lengths:
                row = by.get((name, n), {})
                if key == "passkey":
                    found = f"{row['passkey_found']}/{row['passkey_trials']}" if row.get("passkey_trials") else "-"
                    cells.append(found)
                else:
                    cells.append(cell(row.get(key), fmt))
            if any(c != "-" for c in cells):
                table.append(f"| {name} | " + " | ".join(cells) + " |")
        if table:  # a profile without the test (--quick: no repeat, no passkey) prints no empty table
            header = "| method | " + " | ".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths) + " |"
            out += [f"{title}:\n", header, "| --- |" + " --- |" * len(lengths), *table, ""]
    out += search_table(summary)
    for n in sorted({r["length"] for r in summary["rows"] if is_ablation(r) and not is_candidate(r["settings"])}):
        shown = ablation_rows(summary["rows"], n)
        out += [f"Ablations at {n:,} tokens (the method's default setting in bold):\n",
                "| setting | loss | accuracy |", "| --- | --- | --- |"]
        out += [f"| {r['label'] if is_ablation(r) else '**' + ablation_default(r['label']) + '**'} | "
                f"{cell(r.get('nll'))} | {cell(r.get('accuracy'))} |" for r in shown]
        out.append("")
    return "\n".join(out)


def search_table(summary: dict) -> list[str]:
    """The settings tried for ``auto`` past training, and ``auto`` itself, against the target:
    plain RoPE's loss at the training length (on the same scored tokens) plus 0.01."""
    by = {(r["label"], r["length"]): r for r in summary["rows"]}
    lengths = sorted({r["length"] for r in summary["rows"] if is_candidate(r["settings"])})
    if not lengths:
        return []
    names = [label(s) for s in AUTO_CANDIDATES] + ["auto"]
    plain = by.get(("none", TRAIN_LENGTH), {}).get("nll")
    target = "" if plain is None else (f" plain RoPE's loss at {length_name(TRAIN_LENGTH)} is {plain:.3f}, "
                                       f"so the target is at most {plain + 0.01:.3f} and every passkey;")
    out = [f"The search for `auto` past training ({target.strip()} the rule in server/auto.py):\n",
           "| setting | " + " | ".join(f"loss {length_name(n)}" for n in lengths) + " | "
           + " | ".join(f"passkeys {length_name(n)}" for n in lengths) + " |",
           "| --- |" + " --- |" * (2 * len(lengths))]
    for name in names:
        rows = [by.get((name, n), {}) for n in lengths]
        if not any(rows):
            continue
        losses = [f"{r['nll']:.3f}" if r.get("nll") is not None else "-" for r in rows]
        keys = [f"{r['passkey_found']}/{r['passkey_trials']}" if r.get("passkey_trials") else "-" for r in rows]
        out.append(f"| {name} | " + " | ".join(losses + keys) + " |")
    return out + [""]


def ablation_rows(rows: list[dict], length: int | None) -> list[dict]:
    """The ablations at ``length`` with their methods' default settings among them, each
    method's rows in the order of the varied value."""
    shown = [r for r in rows if r["length"] == length and not r["settings"].get("log_n")
             and r["settings"]["method"] in ABLATED and not is_candidate(r["settings"])
             and (is_ablation(r) or r["label"] == r["settings"]["method"])]
    return sorted(shown, key=lambda r: (METHODS.index(r["settings"]["method"]), ablation_value(r)))


def ablation_value(row: dict) -> float:
    name, default = ABLATED[row["settings"]["method"]]
    return row["settings"].get(name, default)


def ablation_default(method: str) -> str:
    name, default = ABLATED[method]
    return f"{method}({name}={default})"


def markdown_report(report: dict) -> str:
    """A results file's tables with where and when they were measured."""
    planned, missing = report["measurements_planned"], report["measurements_missing"]
    tables = markdown_table(report)
    if missing:
        extent = f"{planned - missing} of the {planned} planned measurements, `-` where not yet measured"
    else:
        # A complete grid still has dashes: log_n's repeat and passkey within training are not planned (identity there).
        extent = f"all {planned} planned measurements" + (", `-` where not planned" if "| - |" in tables else "")
    tokenizer = f", tokenizer {report['tokenizer']}" if report.get("tokenizer") else ""
    return (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}, corpus `{report['corpus']}`"
            f"{tokenizer}): {extent}.\n\n" + tables).rstrip("\n")


def length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def listed(values: dict[str, float], fmt: str = "{:.3f}") -> str:
    return ", ".join(f"`{name}` {fmt.format(value)}" for name, value in values.items())


def ranked(values: dict[str, float], best: int, lowest_first: bool = True) -> dict[str, float]:
    return dict(sorted(values.items(), key=lambda item: item[1] if lowest_first else -item[1])[:best])


def within_training(losses: dict[tuple, float], labels: list[str], train: int) -> list[str]:
    """The cost of each method inside the training length, against plain RoPE (no line where no
    other method was measured there: a grid of named settings past training)."""
    plain = losses[("none", train)]
    costs = {name: losses[(name, train)] - plain for name in labels
             if name != "none" and name in METHODS and (name, train) in losses}
    if not costs:
        return []
    return [f"Within training ({length_name(train)}), each method's loss against plain RoPE's ({plain:.3f}): "
            f"{listed(costs, '{:+.3f}')}."]


def past_training(losses: dict[tuple, float], labels: list[str], train: int, longest: int) -> list[str]:
    """The lowest losses at the longest length, each with its rise from the training length,
    and ReRoPE's against the seeds' expectation (at or below its loss at the training length)."""
    at = {name: losses[(name, longest)] for name in labels if (name, longest) in losses}
    rise = lambda name: f" ({at[name] - losses[(name, train)]:+.3f})" if (name, train) in losses else ""  # noqa: E731
    best = ", ".join(f"`{name}` {value:.3f}{rise(name)}" for name, value in ranked(at, 3).items())
    # a grid of named settings (--settings) may hold plain RoPE at the training length alone
    plain = (f"plain RoPE {at['none']:.3f} ({at['none'] - losses[('none', train)]:+.3f})" if "none" in at
             else f"plain RoPE at {length_name(train)} {losses[('none', train)]:.3f}")
    lines = [f"Lowest loss at {length_name(longest)} (in brackets: the change from {length_name(train)}): {best}; "
             f"{plain}."]
    past = [n for n in sorted({n for _, n in losses}) if n > train and ("rerope", n) in losses]
    if not past or ("rerope", train) not in losses:  # a partial grid without ReRoPE's rows
        return lines
    rises = [losses[("rerope", n)] - losses[("rerope", train)] for n in past]
    expectation = "met" if max(rises) <= 0 else "not met"
    rise_list = ", ".join(f"{rise:+.3f} at {length_name(n)}" for n, rise in zip(past, rises))
    return lines + [f"`rerope` past training against its own {length_name(train)} loss: {rise_list} "
                    f"(the seeds expect no rise: {expectation})."]


def log_n_effect(losses: dict[tuple, float], longest: int) -> list[str]:
    """Each method's loss at the longest length without and with log_n (nothing in a grid without log_n)."""
    pairs = {name: (losses[(name, longest)], losses[(f"{name}(log_n=True)", longest)]) for name in METHODS
             if (name, longest) in losses and (f"{name}(log_n=True)", longest) in losses}
    if not pairs:
        return []
    lowers = ", ".join(f"`{name}` ({a:.3f} to {b:.3f})" for name, (a, b) in pairs.items() if b < a)
    raises = ", ".join(f"`{name}` ({a:.3f} to {b:.3f})" for name, (a, b) in pairs.items() if b >= a)
    return [f"log_n at {length_name(longest)} lowers the loss of {lowers or 'none'}; "
            f"it raises it for {raises or 'none'}."]


def retrieval(rows: dict[tuple, dict], labels: list[str], longest: int) -> list[str]:
    """Passkeys found and copying from far back at the longest length."""
    measured = [name for name in labels if rows.get((name, longest), {}).get("passkey_trials")]
    if not measured:
        return []
    found = {name: rows[(name, longest)]["passkey_found"] for name in measured}
    repeat = {name: rows[(name, longest)]["repeat_accuracy"] for name in measured
              if rows[(name, longest)].get("repeat_accuracy") is not None}
    trials = rows[(measured[0], longest)]["passkey_trials"]
    some = ranked({name: count for name, count in found.items() if count}, len(found), lowest_first=False)
    missed = ", ".join(f"`{name}`" for name, count in found.items() if not count)
    lines = [f"Passkeys found at {length_name(longest)} (of {trials}): {listed(some, '{}') or 'none'}"
             + (f"; 0 for {missed}." if missed else ".")]
    if "none" not in repeat:  # a partial grid without the repeat test
        return lines
    return lines + [f"Repeat accuracy at {length_name(longest)}, highest first: {listed(ranked(repeat, 3, False))}; "
                    f"plain RoPE {repeat['none']:.3f}."]


def readings(report: dict) -> list[str]:
    """The sentences that read the tables, computed from them."""
    rows = {(r["label"], r["length"]): r for r in report["rows"] if not is_ablation(r)}
    losses = {key: row["nll"] for key, row in rows.items() if row.get("nll") is not None}
    lengths, train = sorted({n for _, n in rows}), report["train_length"]
    labels = sorted({name for name, _ in rows}, key=label_order)
    if train not in lengths:
        return [f"Lowest loss at {length_name(lengths[-1])}: "
                f"{listed(ranked({n: losses[(n, lengths[-1])] for n in labels}, 3))}."]
    lines = within_training(losses, labels, train)
    if lengths[-1] > train:
        lines += past_training(losses, labels, train, lengths[-1]) + log_n_effect(losses, lengths[-1])
    return lines + retrieval(rows, labels, lengths[-1])


def cost(report: dict) -> str:
    measured = report["measured_seconds"]
    if report["profile"] == "quick":
        return f"The run took {report['seconds']} s, the server's start included ({measured} s of measurements)."
    return f"The measurements took {measured / 3600:.1f} h in all, one after another."


def markdown(report: dict) -> str:
    """eval.json or eval_quick.json as bench/README.md shows it: tables, then readings."""
    return markdown_report(report) + "\n\n" + "\n".join(f"- {line}" for line in readings(report) + [cost(report)])


def settings_argument(text: str) -> dict:
    """One ``--settings`` value: a ``context_extension`` object as JSON, of a method measured here."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(settings, dict) or settings.get("method") not in METHODS:
        raise argparse.ArgumentTypeError(f"an object whose method is one of {', '.join(METHODS)}, got {text}")
    return settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.speed import add_attention_precision

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="9k tokens (one length past training), methods without log_n, loss + accuracy only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--keys", type=int, default=2, help="passkey trials per depth")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--settings", nargs="+", type=settings_argument, metavar="JSON",
                        help="measure these settings instead of --methods' grid, each a context_extension object "
                             """(e.g. '{"method": "dual_chunk", "chunk_size": 8192, "log_n": true}')""")
    parser.add_argument("--without-log-n", action="store_true", help="only the methods as they are, none with log_n")
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True,
                        help="the window and beta ablations at the first length past training")
    parser.add_argument("--tests", nargs="+", default=TESTS, choices=TESTS,
                        help="which measurements (a partial run spends the CPU on the loss curves first)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--url", help="evaluate a running server instead of starting one")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the started server's model dtype (not float32: results in eval[_quick]_<dtype>*)")
    add_attention_precision(parser, "the started server's --attention-precision (a bfloat16 model on AMX tiles)")
    parser.add_argument("--runs", type=Path, help="results log (default bench/results/<stem>_runs.jsonl)")
    parser.add_argument("--stem", help="the results files' name (default eval[_quick][_<dtype>]): <stem>.json, "
                                       "<stem>_runs.jsonl, its bench/README.md block")
    parser.add_argument("--budget-minutes", type=float,
                        help="start no measurement that would end after this many minutes (by the log's timings); "
                             "the summary covers what finished")
    parser.add_argument("--table", action="store_true",
                        help="rewrite the summary files from the results log, print their markdown and stop")
    parser.add_argument("--readme", action="store_true",
                        help="also rewrite the eval[_quick].json block of bench/README.md")
    args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quick = args.quick
    stem = args.stem or ("eval_quick" if quick else "eval") + ("" if args.dtype == "float32" else f"_{args.dtype}")
    args.runs = args.runs or args.out_dir / f"{stem}_runs.jsonl"
    lengths = [QUICK_LENGTH] if quick else args.lengths
    grid = args.settings or configs(args.methods, log_n_too=not (quick or args.without_log_n))
    jobs = [("loss", s, QUICK_LENGTH) for s in grid] if quick else plan(lengths, grid, args.depths, args.keys,
                                                                         args.ablations)
    jobs = [job for job in jobs if job[0] in args.tests]
    meta = {"machine": harness.machine(),
            "model": f"SmolLM2-135M-Instruct ({args.dtype})", "train_length": TRAIN_LENGTH, "corpus": args.corpus,
            "profile": "quick" if quick else "full",
            "passkey_trials_per_length": 0 if quick else len(args.depths) * args.keys}
    if args.table:
        return report(args.runs, jobs, meta, args.out_dir, stem, args.readme)
    to_do, work = still_to_do(args.runs, jobs)
    # SIGTERM (a job runner, `kill`) ends the run as Ctrl-C does: its server stopped, the
    # summary written; and Ctrl-C works even when a shell started us with SIGINT ignored
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    began = time.perf_counter()
    measure(args, stem, max(lengths), to_do, work, began)
    return report(args.runs, jobs, {**meta, "seconds": round(time.perf_counter() - began)}, args.out_dir, stem,
                  args.readme)


def tokenizer_split() -> str:
    """How the provisioned default model's tokenizer splits text before its BPE: its pre-tokenizers
    (SmolLM2's GGUF declares digits one by one, then the byte-level regex: server/provision.py)."""
    from rope_plugins.server.provision import provision_default_model

    split = json.loads((provision_default_model() / "tokenizer.json").read_text())["pre_tokenizer"]
    parts = split.get("pretokenizers", [split])
    return " + ".join(part["type"] + (" (each digit)" if part.get("individual_digits") else "") for part in parts)


def still_to_do(runs: Path, jobs: list[tuple]) -> tuple[list[tuple], list[float]]:
    """The jobs the results log has no record of, and the seconds each is expected to take
    (from the log's earlier measurements; the median of those estimates, or a minute, when it
    knows nothing of one), said on stderr."""
    records = current_records(runs) if runs.exists() else []  # a loss of an older text is measured again
    done = {record_key(r) for r in records}
    to_do = [job for job in jobs if job_key(job) not in done]
    expected = estimated_seconds(to_do, records)
    guess = statistics.median([s for s in expected if s is not None] or [60.0])  # a fresh log knows nothing
    work = [s if s is not None else guess for s in expected]
    print(f"{len(jobs) - len(to_do)} of {len(jobs)} measurements in {runs.name}; {len(to_do)} to do, "
          f"about {sum(work) / 3600:.1f} h at the pace of its earlier measurements", file=sys.stderr)
    return to_do, work


def measure(args: argparse.Namespace, stem: str, longest: int, to_do: list[tuple], work: list[float],
            began: float) -> None:
    """The jobs to do, against ``--url`` or a server started for them (its log beside the
    results), until done, out of ``--budget-minutes`` or interrupted; each lands in the
    results log as it ends."""
    from rope_plugins.testing.launcher import running_server

    served = longest + 64
    flags = ["--max-model-len", str(1 << (served - 1).bit_length()), "--kv-cache-memory", str(3 << 30),
             "--max-num-seqs", "2", "--log-level", "warning", "--dtype", args.dtype,
             "--attention-precision", args.attention_precision]
    context = running_server(flags, args.out_dir / f"{stem}_server.log") if not args.url else None
    server = context.__enter__() if context else None
    try:
        evaluator = Evaluator(args.url or server.base, args.corpus, args.runs, os.environ.get("ROPE_EXTEND_API_KEY"))
        deadline = began + 60 * args.budget_minutes if args.budget_minutes is not None else math.inf
        measure_within(evaluator, to_do, work, deadline, args.budget_minutes)
    except KeyboardInterrupt:
        print("interrupted: the summary covers what finished (rerun to resume)", file=sys.stderr)
    finally:
        if context:
            context.__exit__(None, None, None)


def measure_within(evaluator: Evaluator, to_do: list[tuple], work: list[float], deadline: float,
                   budget_minutes: float | None) -> None:
    """Each job in turn while the next one fits before ``deadline`` (``fits_budget``)."""
    from tqdm import tqdm

    # the bar counts expected seconds of work, not measurements: measurements differ in
    # length by orders of magnitude, so only this makes its remaining time mean something
    with tqdm(total=round(sum(work)), desc="evaluation", unit="s", unit_scale=True,
              bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}") as bar:
        measured = estimated = 0.0
        for number, (job, expected) in enumerate(zip(to_do, work), start=1):
            if not fits_budget(expected, measured, estimated, deadline - time.perf_counter()):
                bar.write(f"the next measurement ({job[0]} {label(job[1])} {job[2]}, about {expected:.0f} s) "
                          f"does not fit in the {budget_minutes:g}-min budget: stopping (rerun to resume)")
                break
            bar.set_postfix_str(f"{number}/{len(to_do)}: {job[0]} {label(job[1])} {job[2]}")
            record = evaluator.run(job)
            measured, estimated = measured + record["seconds"], estimated + expected
            bar.update(round(expected))


def report(runs: Path, jobs: list[tuple], meta: dict, out_dir: Path, stem: str, document: bool = False) -> int:
    """Summary files and tables from the results log alone (no server needed); with
    ``document``, its block of bench/README.md too."""
    if not runs.exists():
        print(f"no results log at {runs}: nothing measured yet", file=sys.stderr)
        return 1
    records = current_records(runs)
    previous = out_dir / f"{stem}.json"
    if "seconds" not in meta and previous.exists():
        # a --table rewrite keeps the wall time of the run that last measured (server start
        # included), which the results log alone cannot tell
        seconds = json.loads(previous.read_text()).get("seconds")
        meta = meta if seconds is None else {**meta, "seconds": seconds}
    done = {record_key(r) for r in records}
    missing = [job for job in jobs if job_key(job) not in done]
    # records from before the tokenizer split as its GGUF declares carry no "tokenizer": the bare byte-level regex
    split = " and ".join(sorted({r.get("tokenizer", "ByteLevel") for r in records}))
    results = {"date": max(r["date"] for r in records), **meta, "tokenizer": split,
               "measurements_planned": len(jobs), "measurements_missing": len(missing),
               "measured_seconds": round(sum(r["seconds"] for r in records)), **summarize(records)}
    write_outputs(results, out_dir, stem)
    tables = markdown(results)
    print(tables)
    print(f"wrote {out_dir / stem}.json, .csv, .png; {len(jobs) - len(missing)} of {len(jobs)} planned "
          f"measurements done")
    if document:
        from bench.readme import DOCUMENT, write_block

        write_block(stem, tables)
        print(f"rewrote the {stem}.json block of {DOCUMENT}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
