"""Which dtype is faster for ``make run`` on this CPU? The plugin in float32 and in bfloat16, side by side.

    .venv/bin/python bench/dtype_speed.py              # 2k, 8k and 16k prompts, 3 repetitions
    .venv/bin/python bench/dtype_speed.py --markdown   # bench/README.md's block from the results

Two plugin engines on the default model live in this process, one per dtype, with bench/speed.py's
engine arguments; the dtypes take turns (which goes first alternates every repetition). Each
request is one ``make run`` serves: a random prompt of the length, with the settings the server's
``auto`` applies to it (server/auto.py: plain RoPE within training, an extension past it). Per
length and dtype: the prefill of the fresh prompt, the time per output token after it, and the
end-to-end time of a reply of 256 tokens (prefill + 256 x TPOT, as bench/llama_cpp_speed.py
counts it). bench/dtype_check.py checks that a dtype answers correctly; this, which is faster.
Writes bench/results/dtype_speed.json and dtype_speed.png.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness  # noqa: E402
from bench.speed import engine_arguments, random_prompt  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DTYPES = ("float32", "bfloat16")
REPLY_TOKENS = 256  # the end-to-end reply: prefill, then this many tokens


class DtypeEngines:
    """One plugin engine per dtype on the same checkpoint and engine arguments."""

    def __init__(self, model: str, max_len: int):
        from vllm import LLM

        from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs
        from rope_plugins.rules.settings import engine_defaults

        compute_on_every_core()
        # every request names its settings; the default only lets the engine serve past training
        self.engines = {dtype: LLM(**engine_kwargs(model, defaults={"method": "rerope"},
                                                   **engine_arguments(max_len, dtype=dtype)))
                        for dtype in DTYPES}
        config = self.engines[DTYPES[0]].llm_engine.vllm_config.model_config
        self.defaults = engine_defaults(config.hf_config)
        self.vocab = config.get_vocab_size()

    def auto(self, length: int, new_tokens: int) -> dict:
        """The settings the server's ``auto`` gives a request of ``length`` prompt tokens."""
        from rope_plugins.server.auto import auto_settings

        return auto_settings(length + new_tokens, self.defaults.train_length)

    def run(self, dtype: str, ids: list[int], max_tokens: int, settings: dict) -> float:
        """Seconds for one greedy request of ``ids`` and ``max_tokens`` new tokens (past EOS)."""
        from vllm import SamplingParams

        from rope_plugins.frontend.engine_args import extension_request
        from rope_plugins.rules.settings import parse_settings

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt, params = extension_request({"prompt_token_ids": ids}, params, parse_settings(settings, self.defaults))
        began = time.perf_counter()
        self.engines[dtype].generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - began

    def prefill_and_tpot(self, dtype: str, ids: list[int], decode_tokens: int) -> tuple[float, float]:
        """Prefill seconds of the fresh prompt, then seconds per output token on the cached prompt
        (from 1 and 1 + ``decode_tokens`` new tokens), as bench/speed.py measures them."""
        settings = self.auto(len(ids), decode_tokens + 1)
        prefill = self.run(dtype, ids, 1, settings)
        one = self.run(dtype, ids, 1, settings)
        many = self.run(dtype, ids, 1 + decode_tokens, settings)
        return prefill, (many - one) / decode_tokens


def measure(engines: DtypeEngines, lengths: list[int], reps: int, decode_tokens: int, write) -> dict:
    """Per dtype and length, every repetition's prefill and TPOT; ``write`` is called after each."""
    from tqdm import tqdm

    rng = random.Random(0)
    samples = {dtype: {str(n): {"prefill": [], "tpot": []} for n in lengths} for dtype in DTYPES}
    for dtype in DTYPES:  # compilation and first-call work, outside the timings
        engines.run(dtype, [5] * 64, 2, {"method": "none"})
    with tqdm(total=reps * len(lengths) * len(DTYPES), desc="dtype speed", unit="run") as bar:
        for rep in range(reps):
            for n in lengths:
                ids = random_prompt(rng, engines.vocab, n)  # the same prompt for both dtypes
                for dtype in (DTYPES if rep % 2 == 0 else DTYPES[::-1]):
                    prefill, tpot = engines.prefill_and_tpot(dtype, ids, decode_tokens)
                    samples[dtype][str(n)]["prefill"].append(prefill)
                    samples[dtype][str(n)]["tpot"].append(tpot)
                    bar.set_postfix(length=n, dtype=dtype)
                    bar.update()
                write(samples)
    return samples


def summary(samples: dict) -> tuple[dict, dict]:
    """Medians per dtype and length (with the end-to-end reply), and bfloat16's over float32's."""
    median = {dtype: {n: {kind: statistics.median(values) for kind, values in by_kind.items() if values}
                      for n, by_kind in by_length.items()} for dtype, by_length in samples.items()}
    for by_length in median.values():
        for values in by_length.values():
            if "prefill" in values and "tpot" in values:
                values["end_to_end"] = values["prefill"] + REPLY_TOKENS * values["tpot"]
    ratio = {n: {kind: median["bfloat16"][n][kind] / value for kind, value in values.items()
                 if kind in median["bfloat16"].get(n, {})}
             for n, values in median["float32"].items()}
    return median, ratio


def markdown(report: dict) -> str:
    """dtype_speed.json as bench/README.md shows it: the table and which dtype is faster where."""
    lines = [f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}, the plugin with the "
             f"server's `auto`, medians of {report['reps']} interleaved repetitions; end to end = prefill + "
             f"{report['reply_tokens']} x TPOT):", "",
             "| prompt | float32 prefill (s) | bfloat16 prefill (s) | float32 TPOT (ms) | bfloat16 TPOT (ms) "
             "| end to end, bfloat16 / float32 |", "| --- | --- | --- | --- | --- | --- |"]
    median, ratio = report["median"], report["bfloat16_over_float32"]
    for n in report["lengths"]:
        f32, bf16 = median["float32"].get(str(n)), median["bfloat16"].get(str(n))
        if f32 and bf16 and "end_to_end" in ratio.get(str(n), {}):
            lines.append(f"| {n // 1024}k | {f32['prefill']:.1f} | {bf16['prefill']:.1f} | {1e3 * f32['tpot']:.1f} "
                         f"| {1e3 * bf16['tpot']:.1f} | {ratio[str(n)]['end_to_end']:.2f} |")
    faster = [n for n in report["lengths"] if ratio.get(str(n), {}).get("end_to_end", float("inf")) < 1]
    where = ("at every length measured" if faster == report["lengths"]
             else f"at {', '.join(f'{n // 1024}k' for n in faster) or 'no length'} of the lengths measured")
    lines += ["", f"- bfloat16 is faster end to end {where}: the speed half of choosing `make run`'s dtype "
                  "(bench/dtype_check.py's answers are the other)."]
    return "\n".join(lines)


def faster(ratio: dict) -> str:
    """bfloat16 where it is faster end to end at every length measured, float32 otherwise."""
    ends = [values.get("end_to_end") for values in ratio.values()]
    return "bfloat16" if ends and all(e is not None and e < 1 for e in ends) else "float32"


def plot(report: dict, path: Path) -> None:
    """Per length, each dtype's end-to-end seconds as prefill plus the reply's decode."""
    plt = harness.pyplot()

    lengths = [str(n) for n in report["lengths"]]
    figure, axis = plt.subplots(figsize=(7.5, 3.8))
    width = 0.38
    for k, (dtype, colour) in enumerate(zip(DTYPES, ("tab:blue", "tab:orange"))):
        values = [report["median"][dtype].get(n, {}) for n in lengths]
        x = [i + (k - 0.5) * width for i in range(len(lengths))]
        prefill = [v.get("prefill", 0) for v in values]
        decode = [v.get("end_to_end", 0) - v.get("prefill", 0) for v in values]
        axis.bar(x, prefill, width, color=colour, label=f"{dtype} prefill")
        axis.bar(x, decode, width, bottom=prefill, color=colour, alpha=0.45, hatch="//",
                 label=f"{dtype} {report['reply_tokens']} tokens")
    axis.set_xticks(range(len(lengths)), [f"{int(n) // 1024}k" for n in lengths])
    axis.set(xlabel="prompt tokens", ylabel="seconds, end to end", title=f"{report['model']} on {report['machine']}")
    axis.grid(alpha=0.3, axis="y")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens timed for the TPOT")
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype_speed.json")
    parser.add_argument("--markdown", action="store_true", help="print --out as bench/README.md shows it and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())))
        return 0
    # a whole 16k prompt is one engine step, which on a CPU can outlast vLLM's default step timeout
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    from rope_plugins.server.provision import provision_default_model

    longest = max(args.lengths) + args.decode_tokens + 64
    engines = DtypeEngines(str(provision_default_model()), 1 << (longest - 1).bit_length())
    meta = {"machine": harness.machine(),
            "model": "SmolLM2-135M-Instruct", "lengths": args.lengths, "reps": args.reps,
            "decode_tokens": args.decode_tokens, "reply_tokens": REPLY_TOKENS}

    def write(samples: dict) -> dict:
        median, ratio = summary(samples)
        report = {"date": harness.now(), **meta, "median": median,
                  "bfloat16_over_float32": ratio, "faster": faster(ratio), "samples": samples}
        harness.write_json(report, args.out)
        return report

    report = write(measure(engines, args.lengths, args.reps, args.decode_tokens, write))
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
