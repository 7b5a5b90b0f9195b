"""Which dtype gives correct answers on vLLM's CPU backend, per provisioned model, stock and plugin.

    .venv/bin/python bench/dtype_check.py                      # every provisioned model
    .venv/bin/python bench/dtype_check.py --models gemma-3-270m

For each model, dtype (float32, bfloat16) and engine (stock vLLM, the plugin with ``none``):
the loss of 2k tokens of real text (mean negative log-likelihood of its tokens) and the greedy
answer to a question: in a chat with the model's own template, or, for Gemma-3-270M (a
pretrained base model, which does not chat), as a text to complete. A dtype is correct for a
model when both engines answer the question and the loss stays within 0.05 nats of float32's.
Writes bench/results/dtype.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DTYPES = ("float32", "bfloat16")
LOSS_TOLERANCE = 0.05  # nats: more than this above float32's loss is a wrong model, not rounding
TEXT_TOKENS = 2048
# nats: how far each method's bfloat16 loss past training may stray from its float32 loss
METHOD_TOLERANCE = 0.005
QUESTIONS = {  # how each model is asked (a chat, or a text to complete), what, and what a correct answer contains
    "smollm2-135m": ("chat", "What is the capital of France?", ("Paris",)),
    "qwen2.5-coder-0.5b": ("chat", "Write a Python function that returns the sum of a list of numbers.",
                           ("def", "sum")),
    "gemma-3-270m": ("completion", "Question: What is the capital of France?\nAnswer:", ("Paris",)),
}


def real_text_ids(tokenizer, count: int = TEXT_TOKENS) -> list[int]:
    """The first ``count`` tokens of the corpus (CPython's documentation) under ``tokenizer``."""
    from rope_plugins.deploy.corpus import load_corpus

    return tokenizer(load_corpus("pydoc")[: count * 8]).input_ids[:count]


def measure(directory: Path, dtype: str, plugin: bool, kind: str, question: str) -> dict:
    """One engine's loss on the real text and its answer to the question."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rope_plugins.frontend.engine_args import engine_kwargs, extension_request
    from rope_plugins.rules.settings import engine_defaults, parse_settings

    tokenizer = AutoTokenizer.from_pretrained(directory)
    text_ids = real_text_ids(tokenizer)
    if kind == "chat":
        chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        question_ids = tokenizer(chat, add_special_tokens=False).input_ids
    else:
        question_ids = tokenizer(question).input_ids
    common = dict(dtype=dtype, max_model_len=4096, kv_cache_memory_bytes=1 << 29, enforce_eager=True, seed=0)
    llm = LLM(**engine_kwargs(str(directory), **common)) if plugin else LLM(model=str(directory), **common)
    try:
        prompts = [{"prompt_token_ids": text_ids}, {"prompt_token_ids": question_ids}]
        params = [SamplingParams(max_tokens=1, prompt_logprobs=0), SamplingParams(max_tokens=64, temperature=0.0)]
        if plugin:
            defaults = engine_defaults(llm.llm_engine.vllm_config.model_config.hf_config)
            built = [extension_request(p, sp, parse_settings({"method": "none"}, defaults))
                     for p, sp in zip(prompts, params)]
            prompts, params = [b[0] for b in built], [b[1] for b in built]
        scored, answered = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    losses = [-entry[text_ids[i + 1]].logprob for i, entry in enumerate(scored.prompt_logprobs[1:])]
    return {"loss": sum(losses) / len(losses), "answer": answered.outputs[0].text}


def verdicts(rows: list[dict]) -> dict[str, dict[str, bool]]:
    """Per model and dtype: both engines answer the question and stay within the loss tolerance."""
    loss32 = {(r["model"], r["engine"]): r["loss"] for r in rows if r["dtype"] == "float32"}
    result: dict[str, dict[str, bool]] = {}
    for r in rows:
        ok = r["answer_correct"] and r["loss"] <= loss32[(r["model"], r["engine"])] + LOSS_TOLERANCE
        result.setdefault(r["model"], {}).setdefault(r["dtype"], True)
        result[r["model"]][r["dtype"]] &= ok
    return result


def markdown(report: dict) -> str:
    lines = [f"Measured {report['date'][:10]} on {report['machine']}: loss of {report['text_tokens']:,} tokens of "
             "real text (nats per token) and the greedy answer to a question, stock vLLM and the plugin "
             "(`none`).", "", "| model | dtype | engine | loss | answer correct |", "| --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['engine']} | {r['loss']:.3f} | "
                     f"{'yes' if r['answer_correct'] else 'no'} |")
    lines.append("")
    for model, by_dtype in report["verdicts"].items():
        good = [dtype for dtype, ok in by_dtype.items() if ok]
        lines.append(f"- {model}: correct in {', '.join(good) if good else 'neither dtype'}.")
    return "\n".join(lines)


def method_losses(float32_runs: Path, bfloat16_runs: Path, length: int) -> dict:
    """Each setting's loss at ``length`` in both dtypes, from bench/evaluate.py's results logs
    (a float32 server's and a ``--dtype bfloat16`` one's: the same text and scored tokens)."""
    sys.path.insert(0, str(ROOT))
    from bench.evaluate import current_records

    def losses(runs: Path) -> dict[str, float]:
        return {r["label"]: r["nll"] for r in current_records(runs) if r["test"] == "loss" and r["length"] == length}

    float32, bfloat16 = losses(float32_runs), losses(bfloat16_runs)
    rows = [{"setting": label, "float32": float32[label], "bfloat16": bfloat16[label],
             "difference": bfloat16[label] - float32[label],
             "within": abs(bfloat16[label] - float32[label]) <= METHOD_TOLERANCE}
            for label in float32 if label in bfloat16]
    return {"length": length, "tolerance": METHOD_TOLERANCE, "rows": rows, "all_within": all(r["within"] for r in rows)}


def methods_markdown(report: dict) -> str:
    precision = report.get("attention_precision", "float32")
    served = "bfloat16" if precision == "float32" else (
        f"bfloat16 with the attention's operands rounded once (--attention-precision {precision})")
    lines = [f"Each setting's loss at {report['length']:,} tokens (bench/evaluate.py's loss: its last 4,096 "
             f"tokens of real text) served in float32 and in {served}; bfloat16 within {report['tolerance']} "
             "nats of float32:", "", "| setting | float32 | bfloat16 | difference | within |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['float32']:.4f} | {r['bfloat16']:.4f} | {r['difference']:+.4f} | "
              f"{'yes' if r['within'] else '**no**'} |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(QUESTIONS))
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype.json")
    parser.add_argument("--methods-at", type=int, metavar="LENGTH",
                        help="compare the results logs of bench/evaluate.py and evaluate.py --dtype bfloat16 at "
                             "LENGTH instead (writes bench/results/dtype_methods.json)")
    parser.add_argument("--attention-precision", choices=["float32", "bfloat16"], default="float32",
                        help="with --methods-at: the bfloat16 server's (bfloat16: evaluate.py --attention-precision "
                             "bfloat16 --stem eval_bfloat16_rounded; writes dtype_methods_rounded.json)")
    args = parser.parse_args(argv)
    if args.methods_at:
        rounded = args.attention_precision == "bfloat16"
        stem = "eval_bfloat16_rounded" if rounded else "eval_bfloat16"
        report = method_losses(RESULTS / "eval_runs.jsonl", RESULTS / f"{stem}_runs.jsonl", args.methods_at)
        report["attention_precision"] = args.attention_precision
        (RESULTS / f"dtype_methods{'_rounded' if rounded else ''}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(methods_markdown(report))
        return 0 if report["all_within"] else 1
    sys.path.insert(0, str(ROOT))
    from tqdm import tqdm

    from rope_plugins.frontend.engine_args import compute_on_every_core
    from rope_plugins.server.catalog import model_source
    from rope_plugins.server.provision import is_ready, provision

    compute_on_every_core()
    names = args.models or [name for name in QUESTIONS if is_ready(model_source(name))]
    runs = [(name, dtype, engine) for name in names for dtype in DTYPES for engine in ("stock", "plugin")]
    rows, began = [], time.perf_counter()
    for name, dtype, engine in tqdm(runs, desc="dtype check", unit="engine"):
        kind, question, expected = QUESTIONS[name]
        result = measure(provision(name), dtype, engine == "plugin", kind, question)
        rows.append({"model": name, "dtype": dtype, "engine": engine, **result,
                     "answer_correct": all(word in result["answer"] for word in expected)})
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "text_tokens": TEXT_TOKENS,
              "seconds": round(time.perf_counter() - began), "rows": rows, "verdicts": verdicts(rows)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
