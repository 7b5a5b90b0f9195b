"""The plugin against llama.cpp on the same CPU: SmolLM2-135M-Instruct, the same token ids and
threads, prefill and time per output token at long contexts.

    .venv/bin/python -m pip install -e '.[llama-cpp]'   # llama-cpp-python, built from source (minutes)
    .venv/bin/python -m bench llama-cpp                  # 16k and 32k, 256 new tokens

The plugin serves ``auto`` (what a request past training runs) in bfloat16 (``--plugin-dtypes``).
llama.cpp (llama-cpp-python, its defaults: f16 KV cache, 512-token batches) runs F32 and BF16
GGUFs made by llama.cpp's own converter and the Q4_1 GGUF the checkpoint comes from, flash
attention off and on, YaRN from the trained 8k. Interleaved, the report written after each run
(``--resume`` goes on). llama.cpp times one ``generate``; the plugin one request on the fresh
prompt, then 1 and 1 + N tokens on it cached.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import harness
from bench.speed import PluginLLM, random_prompt, rotated

RESULTS = harness.RESULTS
LLAMA_CPP_VERSION = "0.3.36"  # pyproject.toml's [llama-cpp] pin; its sdist holds the converter
WEIGHTS = ("F32", "BF16", "Q4_1")
# the converter and the gguf package it imports, as they sit in llama-cpp-python's sdist's vendor/llama.cpp
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


@dataclass(frozen=True)
class LlamaCppConfig:
    """One way of running llama.cpp: its weights' GGUF type and flash attention (YaRN past training)."""

    weights: str
    flash_attn: bool

    @property
    def name(self) -> str:
        return f"llama.cpp {self.weights}, FA {'on' if self.flash_attn else 'off'}"


LLAMA_CPP_CONFIGS = [LlamaCppConfig(weights, flash) for weights in WEIGHTS for flash in (False, True)]


def converter(cache: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from llama-cpp-python's sdist on PyPI (kept in ``cache``)."""
    tree = cache / f"llama.cpp-{LLAMA_CPP_VERSION}"
    script = tree / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--disable-pip-version-check", "-d", download, f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                       check=True)
        sdist = next(Path(download).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            vendored = f"{archive.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            members = [m for m in archive.getmembers() if m.isfile() and m.name.startswith(vendored)
                       and m.name.removeprefix(vendored).startswith(CONVERTER_FILES)]
            for member in members:
                member.name = member.name.removeprefix(vendored)
            archive.extractall(tree, members=members, filter="data")
    return script


def gguf_files(model: Path, cache: Path) -> dict[str, Path]:
    """The checkpoint as F32 and BF16 GGUFs (converted once, kept in ``cache``) and the pinned Q4_1 GGUF."""
    from rope_plugins.models.provision import provision_gguf

    files = {"Q4_1": provision_gguf()}
    for weights in ("F32", "BF16"):
        out = cache / "gguf" / f"{model.name}.{weights}.gguf"
        if not out.exists():
            partial = out.with_suffix(".partial")
            subprocess.run([sys.executable, str(converter(cache)), str(model), "--outtype", weights.lower(),
                            "--outfile", str(partial)], check=True)
            partial.rename(out)
        files[weights] = out
    return files


def time_generation(tokens, new_tokens: int) -> dict[str, float]:
    """Prefill (to the first token), time per output token after it and end to end, of a token iterator."""
    began = time.perf_counter()
    next(tokens)
    first = time.perf_counter()
    for _ in range(new_tokens):
        next(tokens)
    end = time.perf_counter()
    return {"prefill": first - began, "tpot": (end - first) / new_tokens, "end_to_end": end - began}


def run_llama_cpp(config: LlamaCppConfig, gguf: Path, ids: list[int], new_tokens: int, train_length: int,
                  threads: int) -> dict[str, float]:
    """One generate of ``ids`` on a fresh llama.cpp context just long enough, scaled from ``train_length``."""
    import llama_cpp
    from llama_cpp import llama_cpp as constants

    n_ctx = len(ids) + new_tokens + 16
    scaling = (constants.LLAMA_ROPE_SCALING_TYPE_YARN if n_ctx > train_length  # inside training: plain RoPE
               else constants.LLAMA_ROPE_SCALING_TYPE_NONE)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          flash_attn=config.flash_attn, rope_scaling_type=scaling,
                          rope_freq_scale=min(1.0, train_length / n_ctx), yarn_orig_ctx=train_length, verbose=False)
    try:
        return time_generation(llm.generate(ids, temp=0.0, top_k=1), new_tokens)
    finally:
        llm.close()


class PluginEngine(PluginLLM):
    """The plugin's engine in one dtype, every request under ``auto``'s settings for its length."""

    def __init__(self, model: str, dtype: str, max_model_len: int):
        super().__init__(model, dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=3 << 30,
                         max_num_batched_tokens=max_model_len, seed=0)
        self.dtype, self.train_length = dtype, self.defaults.train_length

    @property
    def name(self) -> str:
        return f"plugin auto, {self.dtype}"

    def settings(self, positions: int) -> dict:
        from rope_plugins.server.auto import auto_settings

        return auto_settings(positions, self.train_length)

    def seconds(self, ids: list[int], max_tokens: int) -> float:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts, params = self.requests([{"prompt_token_ids": ids}], [params], [self.settings(len(ids) + max_tokens)])
        began = time.perf_counter()
        self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - began

    def run(self, ids: list[int], new_tokens: int) -> dict[str, float]:
        """Prefill of the fresh prompt, then 1 and 1 + N tokens on it cached (N tokens' decode)."""
        prefill, one, many = self.seconds(ids, 1), self.seconds(ids, 1), self.seconds(ids, 1 + new_tokens)
        return {"prefill": prefill, "tpot": (many - one) / new_tokens, "end_to_end": prefill + many - one}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--plugin-dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (vLLM: every core)")
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_cpp_speed.json")
    parser.add_argument("--resume", action="store_true", help="keep --out's measurements and run only the rest")
    return parser.parse_args(argv)


class Comparison:
    """The run: its engines, GGUFs and prompts, and what has been measured so far."""

    def __init__(self, args: argparse.Namespace):
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")  # a 32k prompt is one long step
        try:
            import llama_cpp  # noqa: F401
        except ImportError as error:
            raise SystemExit("llama-cpp-python is not installed: .venv/bin/python -m pip install -e '.[llama-cpp]'") \
                from error
        from rope_plugins.frontend.engine_args import compute_on_every_core
        from rope_plugins.models.provision import cache_root, provision_default_model

        self.args, model = args, provision_default_model()
        self.gguf = gguf_files(model, cache_root())
        compute_on_every_core()
        longest = max(args.lengths) + args.new_tokens + 64
        self.engines = [PluginEngine(str(model), dtype, longest) for dtype in args.plugin_dtypes]
        self.report = {"date": harness.now(), "machine": harness.machine(), "threads": args.threads,
                       "model": model.name, "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
                       "train_length": self.engines[0].train_length, "new_tokens": args.new_tokens,
                       "lengths": args.lengths, "llama_cpp_defaults": "f16 KV cache, n_batch 512, greedy",
                       "configs": {}, "plugin_settings": {}, "runs": {}}
        if args.resume and args.out.exists():
            before = json.loads(args.out.read_text())
            self.report.update({key: before[key] for key in ("configs", "plugin_settings", "runs")})

    def jobs(self, index: int) -> list:
        """Every configuration once: the plugin first (what each row is compared with, so a run
        stopped midway still has it), then llama.cpp's, the first moving on by one per length."""
        return [*self.engines, *rotated(LLAMA_CPP_CONFIGS, index)]

    def measure(self, job, ids: list[int]) -> dict[str, float]:
        if isinstance(job, PluginEngine):
            self.report["plugin_settings"][str(len(ids))] = job.settings(len(ids) + self.args.new_tokens + 1)
            return job.run(ids, self.args.new_tokens)
        self.report["configs"][job.name] = asdict(job)
        return run_llama_cpp(job, self.gguf[job.weights], ids, self.args.new_tokens, self.report["train_length"],
                             self.args.threads)

    def run(self) -> dict:
        from tqdm import tqdm

        rng, args = random.Random(0), self.args
        vocab = self.engines[0].llm.llm_engine.vllm_config.model_config.get_vocab_size()
        self.engines[0].seconds([5] * 64, 2)  # warm-up: first-call work
        with tqdm(total=len(args.lengths) * len(self.jobs(0)), desc="llama.cpp vs plugin", unit="run") as bar:
            for index, length in enumerate(args.lengths):
                ids = random_prompt(rng, vocab, length)
                for job in self.jobs(index):
                    if str(length) in self.report["runs"].get(job.name, {}):  # --resume: measured by the run before
                        bar.update()
                        continue
                    bar.set_postfix(length=length, config=job.name)
                    self.report["runs"].setdefault(job.name, {})[str(length)] = self.measure(job, ids)
                    harness.write_json(self.report, args.out)
                    bar.update()
        return self.report


def plot(report: dict, path: Path) -> None:
    """Per length, each configuration's end-to-end seconds as prefill plus decode."""
    plt = harness.pyplot()

    lengths = [str(n) for n in report["lengths"]]
    names = list(report["runs"])
    figure, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 0.45 * len(names) + 1.8), squeeze=False)
    for axis, n in zip(axes[0], lengths):
        runs = [report["runs"][name].get(n) for name in names]
        prefill = [run["prefill"] if run else 0 for run in runs]
        decode = [run["end_to_end"] - run["prefill"] if run else 0 for run in runs]
        colours = ["tab:green" if name.startswith("plugin") else "tab:gray" for name in names]
        axis.barh(names, prefill, color=colours, label="prefill")
        axis.barh(names, decode, left=prefill, color=colours, alpha=0.45, hatch="//",
                  label=f"{report['new_tokens']} new tokens")
        axis.invert_yaxis()
        axis.set(xlabel="seconds, end to end", title=f"{int(n) // 1024}k-token prompt")
        axis.grid(alpha=0.3, axis="x")
        axis.legend(loc="lower right")
    figure.suptitle(f"{report['model']} on {report['machine']}, {report['threads']} threads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    """llama_cpp_speed.json as bench/README.md shows it: every run's times, and the plugin's end to
    end time as a multiple of each (below 1: the plugin is faster); ``-`` where a run was not made."""
    plugin = next(name for name in report["runs"] if name.startswith("plugin auto, bfloat16"))
    rows = []
    for n in map(str, report["lengths"]):
        ours = report["runs"][plugin].get(n)
        rows += [[f"{int(n) // 1024}k", name, f"{run[n]['prefill']:.1f}", f"{run[n]['tpot'] * 1000:.1f}",
                  f"{run[n]['end_to_end']:.1f}", f"{ours['end_to_end'] / run[n]['end_to_end']:.2f}" if ours else None]
                 if n in run else [f"{int(n) // 1024}k", name, None, None, None, None]
                 for name, run in report["runs"].items()]
    return (f"Measured {report['date'][:10]} on {report['machine']} ({report['model']}, llama-cpp-python "
            f"{report['llama_cpp_python']} with {report['threads']} threads and its defaults: "
            f"{report['llama_cpp_defaults']}; one run, interleaved; {report['new_tokens']} new tokens):\n\n"
            + harness.markdown_table(["context", "config", "prefill s", "TPOT ms", "end to end s",
                                      "plugin's end to end x this"], rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = Comparison(args).run()
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))

