"""Which dtype gives correct answers on vLLM's CPU backend, per provisioned model, stock and plugin.

    .venv/bin/python -m bench dtype                      # every provisioned model
    .venv/bin/python -m bench dtype --stock-at 16384     # stock vLLM's own bfloat16 drift past training
    .venv/bin/python -m bench dtype --fp8 bench/results  # each setting's fp8 drift (after the quality runs)

Per model, dtype and engine (stock, the plugin's ``none``): the loss of 2k tokens of real text
and the greedy answer to a question (a chat, or a text to complete for Gemma-3-270M, a base
model). Correct: both engines answer, and the loss is within 0.05 nats of float32's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import harness
from bench.speed import PluginLLM

RESULTS = harness.RESULTS
DTYPES = ("float32", "bfloat16")
LOSS_TOLERANCE = 0.05  # nats: more than this above float32's loss is a wrong model, not rounding
TEXT_TOKENS = 2048
# nats: how far a method's bfloat16 loss past training may stray from its float32 loss
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


def loss_and_answer(directory: Path, plugin: bool, ids: list[int], scored: int, question_ids: list[int] | None = None,
                    *, stock_overrides: dict | None = None, precision: str | None = None, **common) -> tuple:
    """The mean NLL of the last ``scored`` tokens of ``ids`` and the greedy answer to
    ``question_ids`` (None without), on stock vLLM (``stock_overrides`` its hf_overrides) or on
    the plugin, whose requests ask for ``none`` (its default rerope only lets it serve past
    training); the engine is shut down after."""
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in (ids, question_ids) if p is not None]
    params = [SamplingParams(max_tokens=1, prompt_logprobs=0), SamplingParams(max_tokens=64, temperature=0.0)]
    params = params[:len(prompts)]
    if plugin:
        engine = PluginLLM(str(directory), attention_precision=precision, **common)
        llm, (prompts, params) = engine.llm, engine.requests(prompts, params, [{"method": "none"}] * len(prompts))
    else:
        llm = LLM(model=str(directory), **({"hf_overrides": stock_overrides} if stock_overrides else {}), **common)
    try:
        scoring, *answer = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    # prompt_logprobs[i]: the distribution before token i (the first is None)
    chosen = [scoring.prompt_logprobs[i][ids[i]].logprob for i in range(len(ids) - scored, len(ids))]
    return -sum(chosen) / len(chosen), answer[0].outputs[0].text if answer else None


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
    rows = [[r["model"], r["dtype"], r["engine"], f"{r['loss']:.3f}", "yes" if r["answer_correct"] else "no"]
            for r in report["rows"]]
    good = [f"{model} in {' and '.join(d for d, ok in by_dtype.items() if ok) or 'neither dtype'}"
            for model, by_dtype in report["verdicts"].items()]
    return (f"Measured {report['date'][:10]} on {report['machine']}: loss of {report['text_tokens']:,} tokens of "
            "real text (nats per token) and the greedy answer to a question, stock vLLM and the plugin (`none`).\n\n"
            + harness.markdown_table(["model", "dtype", "engine", "loss", "answer correct"], rows)
            + "\n\nBoth engines right and within the loss tolerance: " + "; ".join(good) + ".")


# --stock-at's engines: (engine, dtype, the plugin's attention precision, KV cache), stock vLLM's own
# rounding beside the plugin's two precisions on the same text, and stock's with each fp8 cache
FP8_CACHES = ("fp8_e4m3", "fp8_e5m2")
REFERENCE_RUNS = [("stock", "float32", None, "auto"), ("stock", "bfloat16", None, "auto"),
                  ("plugin", "bfloat16", "float32", "auto"), ("plugin", "bfloat16", "bfloat16", "auto"),
                  *(("stock", "bfloat16", None, kv) for kv in FP8_CACHES)]


def plain_rope_loss(directory: Path, length: int, dtype: str, engine: str, precision: str | None,
                    kv_cache_dtype: str = "auto") -> float:
    """The mean NLL under plain RoPE past training of the quality suite's loss prompt at ``length``
    (the corpus' tokens ending at the same token for every length) and its scored tokens: stock
    vLLM with its position limit raised to ``length``, or the plugin's ``none`` at ``precision``."""
    from transformers import AutoTokenizer

    from bench.quality import loss_window
    from rope_plugins.deploy.corpus import load_corpus

    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids, scored = loss_window(tokenizer(load_corpus("pydoc")[:400_000], add_special_tokens=False).input_ids, length)
    room = length + 64  # the prompt and the one token generated after it
    loss, _ = loss_and_answer(directory, engine == "plugin", ids, scored, precision=precision,
                              stock_overrides={"max_position_embeddings": room}, dtype=dtype, max_model_len=room,
                              kv_cache_memory_bytes=1 << 30, seed=0, kv_cache_dtype=kv_cache_dtype,
                              max_num_batched_tokens=max(length // 2, 8192))
    return loss


def stock_reference(length: int) -> dict:
    """Stock vLLM's loss past training in both dtypes (plain RoPE, all it serves there) beside the
    plugin's ``none`` in bfloat16 at both attention precisions, on the quality suite's loss text:
    how far bfloat16 moves stock vLLM's own loss, the yardstick for METHOD_TOLERANCE; and how far
    each fp8 cache moves it, :func:`fp8_drift`'s."""
    from tqdm import tqdm

    from rope_plugins.models.catalog import model_source
    from rope_plugins.models.provision import provision

    directory = provision(model_source("smollm2-135m"))
    rows = [{"engine": engine, "dtype": dtype, "attention_precision": precision, "kv_cache_dtype": kv,
             "loss": plain_rope_loss(directory, length, dtype, engine, precision, kv)}
            for engine, dtype, precision, kv in tqdm(REFERENCE_RUNS, desc=f"plain RoPE at {length:,}", unit="engine")]
    return {"date": harness.now(), "machine": harness.machine(), "length": length, "tolerance": METHOD_TOLERANCE,
            "rows": against_stock_float32(rows)}


def against_stock_float32(rows: list[dict]) -> list[dict]:
    """Each row's loss less stock vLLM's float32 loss, and whether that is within METHOD_TOLERANCE
    (None for an fp8 cache's: the tolerance is bfloat16's)."""
    [reference] = [r["loss"] for r in rows if r["engine"] == "stock" and r["dtype"] == "float32"]
    return [{**r, "difference": r["loss"] - reference,
             "within": abs(r["loss"] - reference) <= METHOD_TOLERANCE if r.get("kv_cache_dtype", "auto") == "auto"
             else None} for r in rows]


VERDICTS = {True: "yes", False: "**no**", None: "-"}


def stock_markdown(report: dict) -> str:
    rows = [[r["engine"], r["dtype"], r["attention_precision"], r.get("kv_cache_dtype", "auto"), f"{r['loss']:.4f}",
             f"{r['difference']:+.4f}", VERDICTS[r["within"]]] for r in report["rows"]]
    return (f"Measured {report['date'][:10]} on {report['machine']}: plain RoPE's loss at {report['length']:,} "
            "tokens (the quality suite's loss text and scored tokens), stock vLLM in both dtypes and the "
            f"plugin's `none` in bfloat16, each against stock vLLM in float32 (tolerance {report['tolerance']} "
            "nats; stock's with an fp8 cache is the fp8 drift's yardstick):\n\n"
            + harness.markdown_table(["engine", "dtype", "attention precision", "KV cache", "loss", "difference",
                                      "within"], rows))


FP8_MARGIN = 0.005  # nats: how much more than stock's own fp8 drift a method's may be


def fp8_drift(stock: dict, quality: Path) -> dict:
    """Per setting, the plugin's loss with each fp8 cache less its loss with the model's own
    (bfloat16) cache, at ``--stock-at``'s length, from the quality suite's runs with each cache
    (``quality``/kv_bfloat16_<cache>.json); stock vLLM's same drift for plain RoPE (``stock``:
    dtype_stock.json) is the yardstick."""
    loss = {r.get("kv_cache_dtype", "auto"): r["loss"] for r in stock["rows"]
            if r["engine"] == "stock" and r["dtype"] == "bfloat16"}
    losses = {kv: {r["label"]: r["nll"] for r in json.loads((quality / f"kv_bfloat16_{kv}.json").read_text())["rows"]
                   if r["length"] == stock["length"]} for kv in ("auto", *FP8_CACHES)}
    yardstick = {kv: loss[kv] - loss["auto"] for kv in FP8_CACHES}
    return {"date": harness.now(), "machine": stock["machine"],
            "length": stock["length"], "margin": FP8_MARGIN, "yardstick": yardstick,
            "rows": drift_rows(losses, yardstick)}


def drift_rows(losses: dict[str, dict[str, float]], yardstick: dict[str, float]) -> list[dict]:
    """Per setting (``losses[cache][setting]``, "auto" the model's own cache): its loss, each fp8
    cache's drift from it, and whether every drift is within stock's (``yardstick``) + FP8_MARGIN."""
    return [{"setting": label, "bfloat16": loss, **{kv: losses[kv][label] - loss for kv in FP8_CACHES},
             "within": all(abs(losses[kv][label] - loss) <= abs(yardstick[kv]) + FP8_MARGIN for kv in FP8_CACHES)}
            for label, loss in losses["auto"].items()]


def fp8_markdown(report: dict) -> str:
    yardstick = ", ".join(f"{kv} {report['yardstick'][kv]:+.4f}" for kv in FP8_CACHES)
    rows = [[r["setting"], f"{r['bfloat16']:.4f}", *(f"{r[kv]:+.4f}" for kv in FP8_CACHES), VERDICTS[r["within"]]]
            for r in report["rows"]]
    return (f"Measured {report['date'][:10]} on {report['machine']}: SmolLM2-135M-Instruct in bfloat16, the loss "
            f"of the quality suite's text at {report['length']:,} tokens with an fp8 KV cache less that with the "
            f"bfloat16 cache. Stock vLLM's own drift for plain RoPE: {yardstick} nats; within: every format's "
            f"drift at most stock's + {report['margin']} nats.\n\n"
            + harness.markdown_table(["setting", "loss, bfloat16 cache", *(f"drift, {kv}" for kv in FP8_CACHES),
                                      "within"], rows))


def fp8_choice(drift: dict, results: Path) -> dict:
    """What the README says of an fp8 cache: ``drift`` (:func:`fp8_drift`'s) in short, and the fp8
    speed runs in ``results`` (tpot_bfloat16_fp8.json, speed_bfloat16_fp8.json) as ranges."""
    tpot, speed = (json.loads((results / f"{stem}_bfloat16_fp8.json").read_text()) for stem in ("tpot", "speed"))
    span = lambda ratios: [min(ratios), max(ratios)]  # noqa: E731
    per_token = tpot["kv_bytes_per_token"]
    return {"date": max(drift["date"], tpot["date"], speed["date"]), "machine": speed["machine"],
            "length": drift["length"], "bytes_per_token": {"fp8": per_token["plugin"],
                                                           "bfloat16": per_token["plugin_auto_cache"]},
            "drift": {kv: span([r[kv] for r in drift["rows"]]) for kv in FP8_CACHES}, "yardstick": drift["yardstick"],
            "decode_x_bfloat16": span([x for by in tpot["ratio_to_auto_cache"].values() for x in by.values()]),
            "prefill_x_stock": span([x["prefill"] for by in speed["ratio_to_stock"].values() for x in by.values()]),
            "batch_x_stock": speed["batch8"]["throughput_ratio"]}


def choice_markdown(report: dict) -> str:
    drift, per_token, yardstick = report["drift"], report["bytes_per_token"], report["yardstick"]
    (low, high), (first, last) = report["decode_x_bfloat16"], report["prefill_x_stock"]
    return (f"Measured {report['date'][:10]} on {report['machine']} (SmolLM2-135M, bfloat16): "
            f"{per_token['fp8']:,.0f} bytes per token against {per_token['bfloat16']:,.0f}; at {report['length']:,} "
            f"tokens loss drifts {drift['fp8_e4m3'][0]:+.2f} to {drift['fp8_e4m3'][1]:+.2f} nats (`fp8_e5m2`: "
            f"{drift['fp8_e5m2'][0]:+.2f} to {drift['fp8_e5m2'][1]:+.2f}; stock's own: "
            f"{yardstick['fp8_e4m3']:+.2f}, {yardstick['fp8_e5m2']:+.2f}); decode {low:.2f}-{high:.2f}x a bfloat16 "
            f"cache's time; prefill {first:.2f}-{last:.2f}x stock's on fp8; a mixed batch of 8, "
            f"{report['batch_x_stock']:.2f}x its throughput.")


def check_models(names: list[str] | None) -> dict:
    """Per model (``names``, else every provisioned one), dtype and engine: the loss on the real
    text and the answer to the question, correct or not; then the verdicts."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rope_plugins.models.catalog import model_source
    from rope_plugins.models.provision import is_ready, provision

    names = names or [name for name in QUESTIONS if is_ready(model_source(name))]
    runs = [(name, dtype, engine) for name in names for dtype in DTYPES for engine in ("stock", "plugin")]
    rows, began = [], time.perf_counter()
    for name, dtype, engine in tqdm(runs, desc="dtype check", unit="engine"):
        kind, question, expected = QUESTIONS[name]
        directory = provision(name)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        if kind == "chat":
            chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
            question_ids = tokenizer(chat, add_special_tokens=False).input_ids
        else:
            question_ids = tokenizer(question).input_ids
        text_ids = real_text_ids(tokenizer)
        loss, answer = loss_and_answer(directory, engine == "plugin", text_ids, len(text_ids) - 1, question_ids,
                                       dtype=dtype, max_model_len=4096, kv_cache_memory_bytes=1 << 29,
                                       enforce_eager=True, seed=0)
        rows.append({"model": name, "dtype": dtype, "engine": engine, "loss": loss, "answer": answer,
                     "answer_correct": all(word in answer for word in expected)})
    return {"date": harness.now(), "machine": harness.machine(), "text_tokens": TEXT_TOKENS,
            "seconds": round(time.perf_counter() - began), "rows": rows, "verdicts": verdicts(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(QUESTIONS))
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype.json")
    parser.add_argument("--stock-at", type=int, metavar="LENGTH",
                        help="plain RoPE's loss at LENGTH on the quality suite's loss text: stock vLLM in both dtypes, "
                             "the plugin's none in bfloat16 at both attention precisions (writes "
                             "bench/results/dtype_stock.json)")
    parser.add_argument("--fp8", type=Path, metavar="QUALITY_DIR",
                        help="each setting's fp8 drift from the quality suite's QUALITY_DIR/kv_bfloat16_<cache>.json "
                             "against stock's in dtype_stock.json (writes bench/results/dtype_fp8.json, and "
                             "fp8_choice.json from it and the fp8 speed runs)")
    args = parser.parse_args(argv)
    if args.fp8:
        stock = json.loads((RESULTS / "dtype_stock.json").read_text())
        report, out, render = fp8_drift(stock, args.fp8), RESULTS / "dtype_fp8.json", fp8_markdown
        choice = fp8_choice(report, RESULTS)
        harness.write_json(choice, RESULTS / "fp8_choice.json")
        print(choice_markdown(choice))
    else:
        from rope_plugins.frontend.engine_args import compute_on_every_core

        compute_on_every_core()
        if args.stock_at:
            report, out, render = stock_reference(args.stock_at), RESULTS / "dtype_stock.json", stock_markdown
        else:
            report, out, render = check_models(args.models), args.out, markdown
    harness.write_json(report, out)
    print(render(report))
    return 0
