"""Long-context quality of every method on the real default model, through the real server.

    .venv/bin/python -m bench quality --quick            # 9k tokens: every method's loss
    .venv/bin/python -m bench quality                    # 4k-32k, with and without log-n (resumable)
    .venv/bin/python -m bench quality --table --readme   # the summary and its README block, from the log

Per setting and length, over HTTP: **loss**, the mean NLL of the last 4,096 tokens of a text
ending at the same corpus token at every length, and its top-1 accuracy; **repeat**, that
accuracy over a passage's second copy; **passkey**, a 5-digit number hidden at several depths.
Settings: every method at its defaults, the frequency methods also with ``factor: "auto"``,
each with log-n too; past training, the ablations and the search behind ``auto``'s rule; or
``--settings``. Each measurement is appended to bench/results/<stem>_runs.jsonl and skipped when there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness
from rope_plugins.plugin import FP8_CACHE_DTYPES
from rope_plugins.rules.settings import AUTO, METHOD_NAMES, ExtensionSettings, length_factor, positions_used

RESULTS = harness.RESULTS
METHODS = [*METHOD_NAMES, "auto"]
SIZED_METHODS = ["pi", "ntk_old", "ntk_fixed", "ntk_mixed", "yarn"]
TRAIN_LENGTH = 8192
QUICK_LENGTH = 9216  # --quick: one length past training, the loss only
SCORED_TOKENS = 4096
LOSS_TEXT_END = 32768  # every length's loss text ends here in the corpus (or at its length, past it)
TESTS = ["loss", "repeat", "passkey"]
PASSKEY_ANSWER_TOKENS = 8
SCORING_ANSWER_TOKENS = 1  # loss and repeat score the prompt (echo) and generate one token
FIXED_FACTOR = ExtensionSettings.model_fields["factor"].default
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# Settings tried for ``auto`` past training (server/auto.py's rule comes from these): wider
# windows than the default quarter, with log-n; the Self-Extend pairs that keep the far positions
# inside training at 16k or 32k; dual-chunk attention with chunks as long as training.
AUTO_CANDIDATES = [
    *({"method": method, "window": TRAIN_LENGTH * eighths // 8, "log_n": True}
      for method in ("rerope", "leaky_rerope") for eighths in (4, 6)),
    *({"method": "self_extend", "window": TRAIN_LENGTH * eighths // 8, "group": group, **log_n}
      for eighths, group, log_n in ((4, 8, {"log_n": True}), (4, 8, {}), (2, 16, {"log_n": True}), (4, 4, {}),
                                    (6, 8, {}), (6, 16, {}), (7, 32, {}))),
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH, "log_n": True},
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH},
    {"method": "dual_chunk", "chunk_size": TRAIN_LENGTH, "local_window": TRAIN_LENGTH // 8, "log_n": True},
]
# the candidates whose repeat and passkeys are measured too: the loss against finding a fact far back
RETRIEVAL_CANDIDATES = [{"method": "leaky_rerope", "window": TRAIN_LENGTH // 2, "log_n": True},
                        {"method": "self_extend", "window": TRAIN_LENGTH // 2, "group": 8}]
# at the first length past training: ReRoPE's and Leaky ReRoPE's windows beside the default quarter,
# Self-Extend's group beside 8, ntk_mixed's beta beside 0.625
ABLATIONS = [*({"method": m, "window": TRAIN_LENGTH // k} for m in ("rerope", "leaky_rerope") for k in (8, 2)),
             *({"method": "self_extend", "group": g} for g in (4, 16)),
             *({"method": "ntk_mixed", "beta": b} for b in (0.5, 0.75, 1.0))]


def configs(methods: list[str], log_n_too: bool) -> list[dict]:
    """Each method at its defaults, the frequency methods also with ``factor: "auto"``; with
    ``log_n_too`` each of those again with log-n (but ``auto``, which decides log-n itself)."""
    grid = [{"method": m} for m in methods]
    grid += [{"method": m, "factor": "auto"} for m in methods if m in SIZED_METHODS]
    return grid + ([{**s, "log_n": True} for s in grid if s["method"] != "auto"] if log_n_too else [])


def is_the_fixed_factor(job: tuple) -> bool:
    """Whether a ``factor: "auto"`` job resolves to its method's fixed factor, to 1% (at 32k, four
    times training): those rows would measure the fixed rows again, so they are not planned."""
    test, settings, length = job[:3]
    if settings.get("factor") != AUTO:
        return False
    answer = PASSKEY_ANSWER_TOKENS if test == "passkey" else SCORING_ANSWER_TOKENS
    return abs(length_factor(positions_used(length, answer), TRAIN_LENGTH) / FIXED_FACTOR - 1) <= 0.01


def plan(lengths: list[int], grid: list[dict], depths: list[float], keys: int,
         with_ablations: bool = True) -> list[tuple]:
    """The measurements, the most informative per CPU-hour first, so that a run stopped early has
    whole curves: the search for ``auto`` past training; every loss up to the first length past
    training, and the ablations there; repeat and passkey within training; the longer lengths'
    losses; repeat and passkey past training. Passkey depths go deepest first: the filler before a
    needle is the same at every depth, so later trials reuse it through the prefix cache."""
    first_past = next((n for n in lengths if n > TRAIN_LENGTH), max(lengths))
    short, within = [n for n in lengths if n <= first_past], [n for n in lengths if n <= TRAIN_LENGTH]
    past, long = [n for n in short if n > TRAIN_LENGTH], [n for n in lengths if n > first_past]
    plain = [s for s in grid if not s.get("log_n")]
    unsized, scaled = [s for s in plain if s.get("factor") != AUTO], [s for s in grid if s.get("log_n")]

    def losses(group, settings_list):
        return [("loss", s, n) for n in group for s in settings_list]

    def details(group, settings_list):
        return [job for n in group for job in [("repeat", s, n) for s in settings_list] + [
            ("passkey", s, n, depth, round(depth * 100) * 100 + k)
            for s in settings_list for depth in sorted(depths, reverse=True) for k in range(keys)]]

    extra = past and with_ablations
    search = losses(past + long, AUTO_CANDIDATES) + details(past + long, RETRIEVAL_CANDIDATES) if extra else []
    jobs = (search + losses(short, grid) + (losses([first_past], ABLATIONS) if extra else [])
            + details(within, unsized) + losses(long, plain) + losses(long, scaled) + details(past, plain)
            + details(past, scaled) + details(long, plain) + details(long, scaled))
    return [job for job in jobs if not is_the_fixed_factor(job)]


def label(settings: dict) -> str:
    extra = ",".join(f"{k}={v}" for k, v in settings.items() if k != "method")
    return settings["method"] + (f"({extra})" if extra else "")


def job_key(job: tuple) -> tuple:
    """(test, length, sample, label): a planned measurement's identity in the results log."""
    return job[0], job[2], job[4] if job[0] == "passkey" else 0, label(job[1])


def record_key(record: dict) -> tuple:
    return record["test"], record["length"], record["sample"], record["label"]


def loss_window(tokens: list[int], length: int) -> tuple[list[int], int]:
    """The loss's prompt at ``length``, ending at the same corpus token for every length, and how
    many of its last tokens are scored."""
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
        self.model = harness.served_model(base, api_key)
        self.tokens = self.tokenize(load_corpus(corpus)[: 400_000])
        self.filler = self.tokenize(FILLER * 4000)
        self.runs, self.split = runs, tokenizer_split()

    def tokenize(self, text: str) -> list[int]:
        response = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        return response.raise_for_status().json()["tokens"]

    def run(self, job: tuple) -> None:
        test, settings, length, *passkey_at = job
        began = time.perf_counter()
        values = getattr(self, test)(settings, length, *passkey_at)
        harness.append_log(self.runs, {"test": test, "label": label(settings), "settings": settings, "length": length,
                                       "sample": job_key(job)[2], **values, "tokenizer": self.split,
                                       "seconds": round(time.perf_counter() - began, 1), "date": harness.now()})

    def complete(self, prompt: list[int], settings: dict, **fields) -> tuple[Any, dict]:
        """The completion and the settings the server applied (its x-context-extension header)."""
        raw = self.client.completions.with_raw_response.create(
            model=self.model, prompt=prompt, temperature=0, extra_body={"context_extension": settings}, **fields)
        return raw.parse(), json.loads(raw.headers["x-context-extension"])

    def score(self, prompt: list[int], settings: dict, scored: int) -> tuple[float, float, dict]:
        """Mean NLL and top-1 accuracy of the last ``scored`` prompt tokens, and the settings applied."""
        answer, applied = self.complete(prompt, settings, max_tokens=SCORING_ANSWER_TOKENS, echo=True, logprobs=1)
        chosen = answer.choices[0].logprobs.token_logprobs[len(prompt) - scored: len(prompt)]
        tops = answer.choices[0].logprobs.top_logprobs[len(prompt) - scored: len(prompt)]
        accuracy = statistics.fmean(1.0 if lp >= max(top.values()) - 1e-6 else 0.0 for lp, top in zip(chosen, tops))
        return -statistics.fmean(chosen), accuracy, applied

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
        answer, applied = self.complete(self.filler[:at] + needle + self.filler[at:room] + question, settings,
                                        max_tokens=PASSKEY_ANSWER_TOKENS)
        text = answer.choices[0].text
        return {"found": key in text, "depth": depth, "answer": text, "applied": applied}


def tokenizer_split() -> str:
    """How the provisioned default model's tokenizer splits text before its BPE (SmolLM2's GGUF
    declares digits one by one, then the byte-level regex: rope_plugins/models/provision.py)."""
    from rope_plugins.models.provision import provision_default_model

    split = json.loads((provision_default_model() / "tokenizer.json").read_text())["pre_tokenizer"]
    return " + ".join(part["type"] + (" (each digit)" if part.get("individual_digits") else "")
                      for part in split.get("pretokenizers", [split]))


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
        else:
            row["passkey_trials"] += 1
            row["passkey_found"] += int(r["found"])
    for row in rows.values():
        row["passkey"] = row["passkey_found"] / row["passkey_trials"] if row["passkey_trials"] else None
    return {"rows": sorted(rows.values(), key=lambda r: (r["label"], r["length"]))}


def is_default(row: dict) -> bool:
    """A method at its defaults (with or without log-n, or its factor sized to the request)."""
    return {k: v for k, v in row["settings"].items() if k not in ("method", "log_n")} in ({}, {"factor": AUTO})


def ordered_labels(rows: list[dict]) -> list[str]:
    """Methods in METHODS' order, each before its variants."""
    return sorted({r["label"] for r in rows}, key=lambda name: (METHODS.index(name.split("(")[0]), name))


def quality_table(rows: list[dict]) -> str:
    """A row per setting: its loss at each length, then the passkeys it found (found/trials) at each
    length where they were asked for; ``-`` where not measured."""
    lengths = sorted({r["length"] for r in rows})
    asked = [n for n in lengths if any(r["passkey_trials"] for r in rows if r["length"] == n)]
    by = {(r["label"], r["length"]): r for r in rows}
    table = []
    for setting in ordered_labels(rows):
        losses = [by.get((setting, n), {}).get("nll") for n in lengths]
        keys = [by.get((setting, n), {"passkey_trials": 0}) for n in asked]
        table.append([setting, *(None if x is None else f"{x:.3f}" for x in losses),
                      *(f"{k['passkey_found']}/{k['passkey_trials']}" if k["passkey_trials"] else None for k in keys)])
    name = lambda n: f"{n // 1024}k" if n % 1024 == 0 else str(n)  # noqa: E731
    return harness.markdown_table(["setting", *(f"loss {name(n)}" for n in lengths),
                                   *(f"passkeys {name(n)}" for n in asked)], table)


def markdown(report: dict) -> str:
    """A results file as bench/README.md shows it: the loss and passkeys of the methods at their defaults,
    with and without log-n (the factors sized to the request, other settings and the accuracies: in the JSON)."""
    done = report["measurements_planned"] - report["measurements_missing"]
    tokenizer = f", tokenizer {report['tokenizer']}" if report.get("tokenizer") else ""
    shown = [r for r in report["rows"] if is_default(r) and r["settings"].get("factor") != AUTO]
    others = len(report["rows"]) - len(shown)
    head = (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}, corpus `{report['corpus']}`"
            f"{tokenizer}): {done} of {report['measurements_planned']} planned measurements, "
            f"{report['measured_seconds'] / 3600:.1f} h; loss: mean NLL of the last 4,096 tokens; `-`: not measured"
            + (f"; {others} rows of other settings in the JSON." if others else "."))
    return head + "\n\n" + quality_table(shown)


def plot(report: dict, path: Path) -> None:
    """The loss and the passkeys found against the context length, one line per setting at its
    defaults (a colour per method; dashed with log-n, dotted with the factor sized to the request);
    the loss axis clipped above the close-together methods."""
    plt = harness.pyplot()
    rows = [r for r in report["rows"] if is_default(r)]
    lengths = sorted({r["length"] for r in rows})
    colours = dict(zip(METHODS, plt.cm.tab20.colors[0::2] + plt.cm.tab20.colors[1::2]))
    figure, axes = plt.subplots(1, 2, figsize=(16, 5.5))
    titles = ("loss (NLL of the last 4k tokens)", "passkeys found (share)")
    for axis, key, title in zip(axes, ("nll", "passkey"), titles):
        for name in ordered_labels(rows):
            points = [(lengths.index(r["length"]), r[key]) for r in rows
                      if r["label"] == name and r.get(key) is not None]
            style = {(False, False): "-", (True, False): "--", (False, True): ":", (True, True): "-."}[
                "log_n" in name, "factor=auto" in name]
            if points:
                axis.plot(*zip(*points), style, marker="o", markersize=3, label=name, color=colours[name.split("(")[0]])
        axis.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        axis.set(xlabel="context tokens", title=title)
        axis.grid(alpha=0.3)
    losses = [r["nll"] for r in rows if r.get("nll") is not None]
    if losses:  # a collapsed method (plain RoPE past training) would flatten the rest
        middle = statistics.median(losses)
        axes[0].set_ylim(min(losses) - 0.02, min(max(losses), middle + 4 * (middle - min(losses))) + 0.02)
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, names, fontsize=7, loc="center right", title="dashed: log-n; dotted: factor auto")
    figure.suptitle(f"{report['model']}, trained at {TRAIN_LENGTH:,} tokens: the methods past the training length")
    figure.tight_layout(rect=(0, 0, 0.8, 1))
    figure.savefig(path, dpi=100)


def settings_argument(text: str) -> dict:
    """One ``--settings`` value: a ``context_extension`` object as JSON, of a method measured here."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(settings, dict) or settings.get("method") not in METHODS:
        raise argparse.ArgumentTypeError(f"an object whose method is one of {', '.join(METHODS)}, got {text}")
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LENGTH:,} tokens, every method's loss")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--keys", type=int, default=2, help="passkey trials per depth")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--settings", nargs="+", type=settings_argument, metavar="JSON",
                        help="these context_extension objects instead of --methods' grid")
    parser.add_argument("--without-log-n", action="store_true", help="none of the settings with log-n")
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True,
                        help="the ablations and the search for auto's rule, past training")
    parser.add_argument("--tests", nargs="+", default=TESTS, choices=TESTS)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--url", help="evaluate a running server instead of starting one")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the started server's dtype (not float32: the stem ends in _<dtype>)")
    harness.add_attention_precision(parser, "the started server's --attention-precision")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_CACHE_DTYPES],
                        help="the started server's KV cache (not auto: the stem ends in _<it>)")
    parser.add_argument("--stem", help="the results' name (default eval[_quick][_<dtype>])")
    parser.add_argument("--budget-minutes", type=float, help="start nothing that would end after this")
    parser.add_argument("--table", action="store_true", help="only the summary files, from the results log")
    parser.add_argument("--readme", action="store_true", help="also rewrite the stem's bench/README.md block")
    args = parser.parse_args(argv)
    suffixes = [kind for kind, plain in ((args.dtype, "float32"), (args.kv_cache_dtype, "auto")) if kind != plain]
    stem = args.stem or "_".join(["eval_quick" if args.quick else "eval", *suffixes])
    runs = args.out_dir / f"{stem}_runs.jsonl"
    grid = args.settings or configs(args.methods, log_n_too=not (args.quick or args.without_log_n))
    jobs = ([("loss", s, QUICK_LENGTH) for s in grid] if args.quick
            else plan(args.lengths, grid, args.depths, args.keys, args.ablations))
    jobs = [job for job in jobs if job[0] in args.tests]
    cache = "" if args.kv_cache_dtype == "auto" else f", KV cache {args.kv_cache_dtype}"
    meta = {"machine": harness.machine(), "model": f"SmolLM2-135M-Instruct ({args.dtype}{cache})",
            "train_length": TRAIN_LENGTH, "corpus": args.corpus}
    if not args.table:
        measure(args, stem, runs, jobs)
    return report(runs, jobs, meta, args.out_dir, stem, args.readme)


def measure(args: argparse.Namespace, stem: str, runs: Path, jobs: list[tuple]) -> None:
    """The jobs the log lacks, against ``--url`` or a server started for them."""
    records = harness.read_log(runs)
    done = {record_key(r) for r in records}
    to_do = [job for job in jobs if job_key(job) not in done]
    # the time of a (test, length, sample): a passkey's depends on its place in its depth order
    expected = harness.expected_seconds([job_key(job)[:3] for job in to_do],
                                        [(record_key(r)[:3], r["seconds"]) for r in records])
    served = max(job[2] for job in jobs) + 64
    flags = ["--max-model-len", str(1 << (served - 1).bit_length()), "--kv-cache-memory", str(3 << 30),
             "--max-num-seqs", "2", "--log-level", "warning", "--dtype", args.dtype,
             "--attention-precision", args.attention_precision, "--kv-cache-dtype", args.kv_cache_dtype]
    with harness.server_at(args.url, flags, args.out_dir / f"{stem}_server.log") as base:
        evaluator = Evaluator(base, args.corpus, runs, os.environ.get("ROPE_EXTEND_API_KEY"))
        harness.run_grid(to_do, expected, evaluator.run, lambda job: f"{job[0]} {label(job[1])} {job[2]}",
                         "quality", args.budget_minutes)


def report(runs: Path, jobs: list[tuple], meta: dict, out_dir: Path, stem: str, document: bool = False) -> int:
    """The summary files from the results log alone (no server needed); with ``document``, its
    block of bench/README.md too."""
    records = harness.read_log(runs)
    if not records:
        print(f"no results log at {runs}: nothing measured yet", file=sys.stderr)
        return 1
    done = {record_key(r) for r in records}
    results = {"date": max(r["date"] for r in records), **meta,
               "tokenizer": " and ".join(sorted({r.get("tokenizer", "ByteLevel") for r in records})),
               "measurements_planned": len(jobs), "measurements_missing": sum(job_key(job) not in done for job in jobs),
               "measured_seconds": round(sum(r["seconds"] for r in records)), **summarize(records)}
    harness.write_json(results, out_dir / f"{stem}.json")
    plot(results, out_dir / f"{stem}.png")
    print(markdown(results))
    if document:
        from bench.readme import write_block

        write_block(stem, markdown(results))
    return 0
