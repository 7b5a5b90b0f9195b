"""Speed of the plugin against stock vLLM (plain RoPE, same checkpoint, same engine settings).

    .venv/bin/python -m bench speed            # 2k, 8k, 16k x 3 repetitions; scaling to 32k
    .venv/bin/python -m bench speed --cached --dtype bfloat16   # the decode alone: 16k, 32k x 7

Both engines in this process, the configurations interleaved (the order rotating), medians.
Per length and configuration: the prefill of a fresh prompt, and the time per output token
from 1 and 1 + N new tokens on it cached; a batch of 8 mixed settings against 8 plain requests
on stock; KV bytes per token; stock and ReRoPE alone at ``--scaling-lengths`` for the plot.
``--cached`` samples the decode alone, each repetition on the same cached prompt, and the memory's
read speed beside each (it moves by a third within minutes). Writes speed.json or tpot_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from bench import harness
from rope_plugins.plugin import FP8_CACHE_DTYPES

RESULTS = harness.RESULTS
KV_BYTES = 3 << 30
CONFIGS = ["stock", "rerope", "leaky_rerope", "ntk_mixed"]
# the targets against stock in the same dtype (time ratios at every main length of 16k and more: a
# --cached run's TPOT; the batch's throughput ratio): float32's from the issue that made it free,
# bfloat16's from issue 35
TARGETS = {"float32": {"tpot": 1.10, "batch": 0.95}, "bfloat16": {"tpot": 1.00, "batch": 1.0}}
# an fp8 cache's targets (issue 54), TPOT at every length of a --cached run: against stock's fp8,
# and against the plugin's own cache in the model's dtype (its "@auto-cache" configurations)
FP8_TPOT_TARGETS = {"stock": 1.0, "auto_cache": 0.8}
AUTO_CACHE = "@auto-cache"  # a configuration's suffix: the plugin's engine whose cache holds the model's dtype
BATCH_LENGTH, BATCH_TOKENS = 2048, 64  # the batch: 8 prompts of this length, this many new tokens each
BATCH_MIX = [{"method": "rerope"}, {"method": "leaky_rerope"}, {"method": "ntk_mixed"}, {"method": "none"},
             {"method": "yarn"}, {"method": "pi"}, {"method": "rerope", "log_n": True}, {"method": "ntk_fixed"}]


def random_prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    """``length`` random token ids (none of the first hundred, where special tokens sit)."""
    return [rng.randrange(100, min(vocab, 40000)) for _ in range(length)]


class PluginLLM:
    """The plugin's engine (its default ReRoPE, so that a request's settings alone say what serves)
    and its requests, each prompt under its own settings fields over the engine's defaults."""

    def __init__(self, model: str, **engine) -> None:
        from vllm import LLM

        from rope_plugins.frontend.engine_args import engine_kwargs
        from rope_plugins.rules.settings import engine_defaults

        self.llm = LLM(**engine_kwargs(model, defaults={"method": "rerope"}, **engine))
        self.defaults = engine_defaults(self.llm.llm_engine.vllm_config.model_config.hf_config)

    def requests(self, prompts: list[dict], params: list, fields: list[dict]) -> tuple[list, list]:
        """vLLM's prompts and sampling parameters of ``prompts`` and ``params`` under ``fields``,
        salted for the prefix cache like any other request's."""
        from rope_plugins.frontend.engine_args import extension_request
        from rope_plugins.rules.settings import parse_settings

        built = [extension_request(p, s, parse_settings(f, self.defaults)) for p, s, f in zip(prompts, params, fields)]
        return [prompt for prompt, _ in built], [sp for _, sp in built]


def rotated(configs: list, rep: int) -> list:
    """The configurations in the order of repetition ``rep``: the first moves on by one each time."""
    shift = rep % len(configs)
    return configs[shift:] + configs[:shift]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help="default 2k 8k 16k (--cached: 16k 32k)")
    parser.add_argument("--reps", type=int, help="default 3 (--cached: 7)")
    parser.add_argument("--decode-tokens", type=int, help="default 32 (--cached: 64)")
    parser.add_argument("--scaling-lengths", type=int, nargs="*", default=[4096, 32768],
                        help="extra lengths for stock and rerope only, once each (the scaling plot)")
    parser.add_argument("--cached", action="store_true",
                        help="the decode alone, each repetition on the same cached prompt (default out: tpot_<dtype>)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="both engines' model dtype (weights, activations and KV cache)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", *FP8_CACHE_DTYPES], default="auto",
                        help="both engines' KV cache (auto: the model's dtype)")
    harness.add_attention_precision(
        parser, "a bfloat16 model's attention on bfloat16 dot products (AMX tiles; the decode's raw keys): each "
                "operand rounded once, as stock vLLM's (bfloat16, the server's default) or to 2^-16 (float32)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    defaults = ([16384, 32768], 7, 64) if args.cached else ([2048, 8192, 16384], 3, 32)
    args.lengths, args.reps, args.decode_tokens = (given or default for given, default in zip(
        (args.lengths, args.reps, args.decode_tokens), defaults))
    args.scaling_lengths = [] if args.cached else args.scaling_lengths
    cache = "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    args.out = args.out or RESULTS / (f"tpot_{args.dtype}{cache}.json" if args.cached else f"speed{cache}.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = SpeedRun(args)
    rng = random.Random(0)
    for config in ("stock", "rerope"):  # a short request per engine: compilation, first-call work
        run.run(config, [[5] * 64], 2)
    if args.cached:
        run.measure_cached(rng)
    else:
        run.measure_batch(rng)
        run.measure_lengths(rng)
    report = json.loads(args.out.read_text())  # as bench/README.md reads it: lengths as strings
    if not args.cached:
        plot(report, args.out.with_suffix(".png"))
    print((cached_markdown if args.cached else markdown)(report))


class SpeedRun:
    """Stock vLLM and the plugin's engine in one process, each request timed by its configuration
    (``"stock"``, or a method's name for the plugin), and what the run has measured so far: per
    configuration and length the seconds of each repetition, by kind ("prefill", "tpot";
    ``--cached``: TPOT alone), and the batch's tokens per second."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Both engines on the default model on every core, with the same engine arguments: a
        context long enough for every length (the batch's too) and the decode tokens, rounded up
        to a power of two; a whole long prompt in at most two steps. Stock vLLM's
        ``max_position_embeddings`` is raised to that so that it accepts as long a prompt."""
        # a whole 32k prompt is one engine step, which on a CPU can outlast vLLM's default step timeout
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
        from vllm import LLM

        from rope_plugins.frontend.engine_args import compute_on_every_core
        from rope_plugins.models.provision import provision_default_model

        lengths = args.lengths + args.scaling_lengths + ([] if args.cached else [BATCH_LENGTH])
        served, model = 1 << (max(lengths) + args.decode_tokens + 64 - 1).bit_length(), str(provision_default_model())
        compute_on_every_core()
        common = dict(kv_cache_memory_bytes=KV_BYTES, max_model_len=served,
                      max_num_batched_tokens=max(served // 2, 8192), seed=0, dtype=args.dtype,
                      kv_cache_dtype=args.kv_cache_dtype)
        self.stock = LLM(model=model, hf_overrides={"max_position_embeddings": served}, **common)
        self.plugin = PluginLLM(model, attention_precision=args.attention_precision, **common)
        # a --cached fp8 run also times the plugin on a cache of the model's dtype: the fp8 cache's own gain
        self.plugin_auto_cache = None if args.kv_cache_dtype == "auto" or not args.cached else PluginLLM(
            model, attention_precision=args.attention_precision, **{**common, "kv_cache_dtype": "auto"})
        self.configs = CONFIGS + ([f"{c}{AUTO_CACHE}" for c in CONFIGS[1:]] if self.plugin_auto_cache else [])
        self.vocab = self.plugin.llm.llm_engine.vllm_config.model_config.get_vocab_size()
        self.args, self.all_lengths = args, sorted(set(args.lengths + args.scaling_lengths))
        self.samples: dict[str, dict[int, dict | list]] = (
            {c: {n: [] for n in args.lengths} for c in self.configs} if args.cached else
            {c: {n: {"prefill": [], "tpot": []} for n in self.all_lengths} for c in CONFIGS})
        self.batch: dict[str, list[float]] = {"plugin_mixed": [], "stock_plain": []}
        self.read_bandwidth: list[float] = []  # --cached: GB/s, once per repetition

    def run(self, config, prompts: list[list[int]], max_tokens: int) -> float:
        """Seconds for requests of ``prompts`` and ``max_tokens`` new tokens each (greedy, past EOS):
        stock's as they are, the plugin's under ``config`` (a method's name, or each prompt's settings fields)."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": ids} for ids in prompts]
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
        llm, plugin = self.stock, self.plugin
        if isinstance(config, str) and config.endswith(AUTO_CACHE):
            plugin, config = self.plugin_auto_cache, config.removesuffix(AUTO_CACHE)
        if config != "stock":
            fields = [{"method": config}] * len(prompts) if isinstance(config, str) else config
            llm, (prompts, params) = plugin.llm, plugin.requests(prompts, params, fields)
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began

    def tpot(self, config: str, ids: list[int]) -> float:
        """Seconds per output token on the cached prompt ``ids``, from 1 and 1 + ``--decode-tokens`` new tokens."""
        one = self.run(config, [ids], 1)
        return (self.run(config, [ids], 1 + self.args.decode_tokens) - one) / self.args.decode_tokens

    def measure_batch(self, rng: random.Random) -> None:
        """A batch of 8 concurrent requests, mixed settings vs 8 plain ones on stock vLLM, once
        per repetition (which goes first alternates)."""
        for rep in range(self.args.reps):
            prompts = [random_prompt(rng, self.vocab, BATCH_LENGTH) for _ in BATCH_MIX]
            for name, config in [("plugin_mixed", BATCH_MIX), ("stock_plain", "stock")][::1 if rep % 2 == 0 else -1]:
                seconds = self.run(config, prompts, BATCH_TOKENS)
                self.batch[name].append(len(prompts) * BATCH_TOKENS / seconds)

    def measure_lengths(self, rng: random.Random) -> None:
        """Prefill and TPOT of every configuration at the main lengths, ``--reps`` times, then of
        stock and rerope at the sweep's other lengths; the report written after every run."""
        from tqdm import tqdm

        args = self.args
        jobs = [(rep, n, CONFIGS) for rep in range(args.reps) for n in args.lengths]
        jobs += [(0, n, CONFIGS[:2]) for n in args.scaling_lengths if n not in args.lengths]  # once each
        with tqdm(total=sum(len(configs) for *_, configs in jobs), desc="speed", unit="run") as bar:
            for rep, n, configs in jobs:
                for config in rotated(configs, rep):
                    ids = random_prompt(rng, self.vocab, n)
                    prefill = self.run(config, [ids], 1)  # the fresh prompt: one step's worth of new tokens
                    tpot = self.tpot(config, ids)
                    self.samples[config][n]["prefill"].append(prefill)
                    self.samples[config][n]["tpot"].append(tpot)
                    bar.set_postfix(length=n, config=config)
                    bar.update()
                    self.write_report()

    def measure_cached(self, rng: random.Random) -> None:
        """``--cached``: per configuration and length, ``--reps`` TPOT samples on one cached prompt;
        the report written after every length."""
        from tqdm import tqdm

        args, configs = self.args, self.configs
        with tqdm(total=len(args.lengths) * len(configs) * (args.reps + 1), desc="tpot", unit="run") as bar:
            for n in args.lengths:
                prompts = {config: random_prompt(rng, self.vocab, n) for config in configs}
                for config in configs:  # the prefill that puts each prompt in its engine's cache
                    self.run(config, [prompts[config]], 1)
                    bar.update()
                for rep in range(args.reps):
                    self.read_bandwidth.append(read_bandwidth())  # beside the decode, whose reads it bounds
                    for config in rotated(configs, rep):
                        self.samples[config][n].append(self.tpot(config, prompts[config]))
                        bar.set_postfix(length=n, config=config)
                        bar.update()
                self.write_report()

    def head(self) -> dict:
        """What every report of this run says first: what ran, and how."""
        args = self.args
        precision = "" if args.dtype == "float32" else f"; the plugin's attention precision {args.attention_precision}"
        llms = {"stock": self.stock, "plugin": self.plugin.llm,
                **({"plugin_auto_cache": self.plugin_auto_cache.llm} if self.plugin_auto_cache else {})}
        caches = {name: llm.llm_engine.vllm_config.cache_config for name, llm in llms.items()}
        kv_bytes = {name: KV_BYTES / (cache.num_gpu_blocks * cache.block_size) for name, cache in caches.items()}
        return {"date": harness.now(), "machine": harness.machine(),
                "model": f"SmolLM2-135M-Instruct ({args.dtype}{precision})", "dtype": args.dtype,
                "attention_precision": args.attention_precision, "kv_cache_dtype": args.kv_cache_dtype,
                "reps": args.reps, "decode_tokens": args.decode_tokens, "lengths": args.lengths,
                "kv_bytes_per_token": kv_bytes}

    def report(self) -> dict:
        """The report from what has been measured so far: ``--cached``'s the summary of its samples;
        else that of the main lengths, then the scaling sweep's medians, all samples and the batch."""
        if self.args.cached:
            return {**summary(self.samples, self.head()), "read_gb_per_second": self.read_bandwidth}
        main = {c: {n: by_length[n] for n in self.args.lengths} for c, by_length in self.samples.items()}
        batch = medians(self.batch)
        return {**summary(main, self.head()), "scaling_lengths": self.all_lengths,
                "scaling": {c: medians(self.samples[c]) for c in CONFIGS[:2]}, "samples": self.samples,
                "batch8": {"length": BATCH_LENGTH, "new_tokens": BATCH_TOKENS, "tokens_per_second": batch,
                           "throughput_ratio": batch["plugin_mixed"] / batch["stock_plain"]}}

    def write_report(self) -> None:
        """The report, written to ``--out`` (after every run, so a run that dies keeps its results)."""
        harness.write_json(self.report(), self.args.out)


def read_bandwidth() -> float:
    """GB/s of PyTorch's sum of 1 GiB of float32 (past the L3 caches here) on every core it uses: a byte read once."""
    import torch

    buffer, began = torch.ones(1 << 28), time.perf_counter()
    buffer.sum()
    return buffer.nbytes / (time.perf_counter() - began) / 1e9


def decode_reads(report: dict, config: str, n: str, bandwidth: float) -> list[str]:
    """A --cached run's KV-cache MB per step of ``config`` at ``n``, their GB/s over its TPOT (all of the step's
    time: a floor of the attention's own rate), and that over the run's read ``bandwidth``."""
    engine = "stock" if config == "stock" else "plugin_auto_cache" if config.endswith(AUTO_CACHE) else "plugin"
    step = report["kv_bytes_per_token"][engine] * int(n)
    rate = step / report["median"][config][n] / 1e9
    return [f"{step / 1e6:.0f}", f"{rate:.1f}", f"{rate / bandwidth:.2f}"]


def medians(samples: dict) -> dict:
    """The median of every list in a nest of dicts of samples, the nesting kept; those with none yet left out."""
    nested = {k: medians(v) if isinstance(v, dict) else statistics.median(v) for k, v in samples.items() if v}
    return {k: v for k, v in nested.items() if v != {}}


def ratios(values: dict, to: dict) -> dict:
    """``values`` over ``to``, leaf by leaf in two nests of dicts, where both have the leaf."""
    return {k: ratios(v, to[k]) if isinstance(v, dict) else v / to[k] for k, v in values.items() if k in to}


def summary(samples: dict, head: dict) -> dict:
    """``head``, then per configuration and length the medians of ``samples``, their ratios to
    stock's (and, with an fp8 cache, each method's to its own on a cache of the model's dtype)
    and the samples (seconds)."""
    median = {c: medians(by_length) for c, by_length in samples.items()}
    to_auto = {c: ratios(median[c], median[c + AUTO_CACHE]) for c in median if c + AUTO_CACHE in median}
    to_stock = {c: ratios(by_length, median["stock"]) for c, by_length in median.items() if c != "stock"}
    return {**head, "median": median, "ratio_to_stock": to_stock,
            **({"ratio_to_auto_cache": to_auto} if to_auto else {}), "samples": samples}


def cached_markdown(report: dict) -> str:
    """A ``--cached`` report as bench/README.md shows it: a table of medians and the targets read (an fp8
    run's also against the plugin on a cache of the model's dtype; runs since 2026-12-01, its KV reads)."""
    to_stock, to_auto = report["ratio_to_stock"], report.get("ratio_to_auto_cache", {})
    bandwidth = statistics.median(report["read_gb_per_second"]) if "read_gb_per_second" in report else None
    rows = [[f"{int(n) // 1024}k", config, f"{report['median'][config][n] * 1e3:.1f}",
             f"{1.0 if config == 'stock' else to_stock[config][n]:.2f}",
             *([f"{to_auto[config][n]:.2f}" if config in to_auto else "-"] if to_auto else []),
             *(decode_reads(report, config, n, bandwidth) if bandwidth else [])]
            for n in map(str, report["lengths"]) for config in report["median"]]
    limits = [("stock's time", to_stock, TARGETS[report["dtype"]]["tpot"])]  # (against what, the ratios, the limit)
    if to_auto:  # the fp8 cache's: against stock's fp8, and its own gain
        limits = [("stock's time on its fp8 cache", {c: r for c, r in to_stock.items() if c in to_auto},
                   FP8_TPOT_TARGETS["stock"]),
                  ("the plugin's time on a cache of the model's dtype", to_auto, FP8_TPOT_TARGETS["auto_cache"])]
    lines = []
    for what, ratios_of, limit in limits:
        missed = [f"{config} at {int(n) // 1024}k ({ratio:.2f}x)" for config, by_length in ratios_of.items()
                  for n, ratio in by_length.items() if ratio > limit]
        lines.append(f"- Targets (at most {', '.join(f'{c} {limit}x' for c in ratios_of)} {what}): "
                     + ("every one met." if not missed else "not met by " + ", ".join(missed) + "."))
    columns = ["context", "config", "TPOT ms (median)", "x stock", *(["x its auto cache"] if to_auto else []),
               *(["KV MB per step", "KV GB/s", "x read bandwidth"] if bandwidth else [])]
    read = f"; read bandwidth {bandwidth:.1f} GB/s" if bandwidth else ""
    cache = f"; KV caches {report['kv_cache_dtype']}, {AUTO_CACHE}: the model's dtype" if to_auto else ""
    return (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}{cache}; medians of "
            f"{report['reps']} interleaved repetitions on cached prompts; TPOT from {report['decode_tokens']} "
            f"new tokens{read}):\n\n" + harness.markdown_table(columns, rows) + "\n\n" + "\n".join(lines))


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()

    figure, (prefill, tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves = {config: report.get("scaling", {}).get(config, values) for config, values in report["median"].items()}
    for config, curve in curves.items():  # stock and rerope: the whole sweep
        lengths = sorted(curve, key=int)
        prefill.plot([int(n) for n in lengths], [curve[n]["prefill"] for n in lengths], "o-", label=config)
        tpot.plot([int(n) for n in lengths], [curve[n]["tpot"] * 1000 for n in lengths], "o-", label=config)
    prefill.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill seconds",
                title="prefill time vs context (log-log)")
    tpot.set(xlabel="context tokens", ylabel="ms per output token", title="decode time per token vs context")
    for axis in (prefill, tpot):
        axis.grid(alpha=0.3, which="both")
        axis.legend()
    figure.suptitle(f"SmolLM2-135M {report.get('dtype', 'float32')}, {report['machine']}, medians of {report['reps']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    """speed.json (or a run in another dtype) as bench/README.md shows it: the medians of the main
    lengths with their ratios to stock, and the batch of 8 (the scaling sweep is in the plot)."""
    rows = [[f"{int(n) // 1024}k", config, f"{values[n]['prefill']:.2f}",
             f"{values[n]['prefill'] / report['median']['stock'][n]['prefill']:.2f}", f"{values[n]['tpot'] * 1000:.1f}",
             f"{values[n]['tpot'] / report['median']['stock'][n]['tpot']:.2f}"]
            for n in map(str, report["lengths"]) for config, values in report["median"].items()]
    batch, target = report["batch8"], TARGETS[report.get("dtype", "float32")]["batch"]
    return (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}; medians of {report['reps']}; "
            f"TPOT from {report['decode_tokens']} new tokens on the cached prompt):\n\n"
            + harness.markdown_table(["context", "config", "prefill s", "x stock", "TPOT ms", "x stock"], rows)
            + f"\n\nA batch of 8 concurrent {batch['length']:,}-token requests with 8 different settings: "
            f"{batch['tokens_per_second']['plugin_mixed']:.1f} tokens/s against "
            f"{batch['tokens_per_second']['stock_plain']:.1f} for 8 plain requests on stock vLLM "
            f"(x{batch['throughput_ratio']:.2f}, target x{target}).")

