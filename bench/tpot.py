"""Time per output token alone, plugin against stock vLLM, each on a prompt already in its cache.

    .venv/bin/python bench/tpot.py --dtype bfloat16 --lengths 16384 32768 --reps 7

bench/speed.py measures a decode once per fresh prompt (each repetition pays a prefill), so its
three time-per-output-token samples per configuration are few for a machine whose memory speed
moves by a third within minutes. Here each configuration's prompt of each length is prefilled
once, then ``--reps`` repetitions (the configurations' order rotating) time 1 and
1 + ``--decode-tokens`` new tokens on it: the difference over the tokens is one sample. A
length's prompts are measured together and fit the engines' caches side by side (3 GiB each:
the plugin's three methods at 32k in bfloat16 take 2.3 GB). Both engines and the configurations
are bench/speed.py's. Writes bench/results/tpot[_<dtype>].json (``--out``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness, speed  # noqa: E402
from bench.speed import CONFIGS, TARGETS, SideBySide, rotated  # noqa: E402


def measure(engines: SideBySide, lengths: list[int], reps: int, decode_tokens: int, out: Path, head: dict) -> dict:
    """Per configuration and length, ``reps`` TPOT samples on one cached prompt; the report
    written after every length."""
    from tqdm import tqdm

    rng, samples = random.Random(0), {c: {} for c in CONFIGS}
    with tqdm(total=len(lengths) * len(CONFIGS) * (reps + 1), desc="tpot", unit="run") as bar:
        for n in lengths:
            prompts = {config: engines.prompt(rng, n) for config in CONFIGS}
            for config in CONFIGS:  # the prefill that puts each prompt in its engine's cache
                engines.run(config, prompts[config], 1)
                bar.update()
            for rep in range(reps):
                for config in rotated(CONFIGS, rep):
                    one = engines.run(config, prompts[config], 1)
                    many = engines.run(config, prompts[config], 1 + decode_tokens)
                    samples[config].setdefault(str(n), []).append((many - one) / decode_tokens)
                    bar.set_postfix(length=n, config=config)
                    bar.update()
            report = summary(samples, head)
            harness.write_json(report, out)
    return report


def summary(samples: dict[str, dict[str, list[float]]], head: dict) -> dict:
    """Medians, ratios to stock's median and the samples (seconds per token), by configuration and length."""
    median = {c: {n: statistics.median(v) for n, v in by_length.items()} for c, by_length in samples.items()}
    ratio = {c: {n: median[c][n] / median["stock"][n] for n in median[c]} for c in CONFIGS if c != "stock"}
    return {**head, "date": harness.now(),
            "median": median, "ratio_to_stock": ratio, "samples": samples}


def markdown(report: dict) -> str:
    """The report as bench/README.md shows it: a table of medians and the targets read."""
    targets = TARGETS[report["dtype"]]["tpot"]
    lines = [f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}; medians of "
             f"{report['reps']} interleaved repetitions on cached prompts; TPOT from {report['decode_tokens']} "
             "new tokens):", "", "| context | config | TPOT ms (median) | x stock |", "| --- | --- | --- | --- |"]
    for n in map(str, report["lengths"]):
        for config in CONFIGS:
            ratio = 1.0 if config == "stock" else report["ratio_to_stock"][config][n]
            median = report["median"][config][n] * 1e3
            lines.append(f"| {int(n) // 1024}k | {config} | {median:.1f} | {ratio:.2f} |")
    missed = [f"{config} at {int(n) // 1024}k ({ratio:.2f}x)" for config, by_length in report["ratio_to_stock"].items()
              for n, ratio in by_length.items() if ratio > targets[config]]
    lines += ["", "- Targets (at most " + ", ".join(f"{c} {t}x" for c, t in targets.items()) + " stock's time): "
              + ("every one met." if not missed else "not met by " + ", ".join(missed) + ".")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=speed.DTYPES, default="bfloat16")
    harness.add_attention_precision(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = args.out or speed.RESULTS / f"tpot_{args.dtype}.json"
    from rope_plugins.models.provision import provision_default_model

    model = str(provision_default_model())
    engines = SideBySide.for_tokens(model, max(args.lengths) + args.decode_tokens + 64, args.dtype,
                                    args.attention_precision)
    engines.warm_up()
    head = {"machine": harness.machine(),
            "model": f"SmolLM2-135M-Instruct ({speed.model_dtype(args)})", "dtype": args.dtype,
            "attention_precision": args.attention_precision, "reps": args.reps, "decode_tokens": args.decode_tokens,
            "lengths": args.lengths}
    print(markdown(measure(engines, args.lengths, args.reps, args.decode_tokens, out, head)))


if __name__ == "__main__":
    main()
