"""EleutherAI's lm-evaluation-harness (``lm-eval``, the bench extra) as a subprocess against a
running server: one run of its CLI (``python -m lm_eval run``) with one of its OpenAI-compatible
API models, offline, and its results read back. The tests' checks
(``tests/support/lm_eval_checks.py``) and ``bench/ruler.py`` run it so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def lm_eval_command(model_type: str, model_args: dict[str, Any], tasks: list[str], out: Path, *,
                    include_path: Path | None = None, limit: int | None = None, apply_chat_template: bool = False,
                    gen_kwargs: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None) -> list[str]:
    """``python -m lm_eval run`` of ``tasks`` with samples logged under ``out``."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model_type,
               "--model_args", ",".join(f"{key}={value}" for key, value in model_args.items()),
               "--tasks", ",".join(tasks), "--output_path", str(out), "--log_samples"]
    if include_path is not None:
        command += ["--include_path", str(include_path)]
    if limit is not None:
        command += ["--limit", str(limit)]
    if apply_chat_template:
        command.append("--apply_chat_template")
    if gen_kwargs:
        command += ["--gen_kwargs", json.dumps(gen_kwargs)]
    if metadata:
        command += ["--metadata", json.dumps(metadata)]
    return command


def offline_environment(scratch: Path, api_key: str | None) -> dict[str, str]:
    """lm-eval's environment: no Hugging Face Hub, datasets cached under ``scratch``, and the
    server's key (its local-* models send ``OPENAI_API_KEY`` as a bearer token), never the caller's."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(scratch / "hf_datasets"), "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    if api_key is not None:
        env["OPENAI_API_KEY"] = api_key
    return env


def run_lm_eval(model_type: str, model_args: dict[str, Any], task: str | list[str], scratch: Path, *,
                api_key: str | None = None, timeout: float = 600, **options: Any) -> dict[str, Any]:
    """Runs lm-eval on a task, or several in one run (``options``: :func:`lm_eval_command`'s), and
    returns {"tasks": each task's {"metrics" (name -> value, lm-eval's ",none" filter suffix
    dropped), "n" (items evaluated), "samples" (lm-eval's per-item records, each with "resps" and
    the metrics)}, "model_type", "results" (lm-eval's whole results JSON), "command", "wall_s",
    "log" (its output)}; of one task, its entries at the top too, with "task". Raises
    RuntimeError with lm-eval's output when it fails (a request that fails once fails the run:
    max_retries=1 unless ``model_args`` says otherwise)."""
    tasks = [task] if isinstance(task, str) else list(task)
    scratch = Path(scratch)
    out = Path(tempfile.mkdtemp(prefix=f"lm_eval_{tasks[0]}_{model_type}_", dir=scratch))
    command = lm_eval_command(model_type, {"max_retries": 1, **model_args}, tasks, out, **options)
    start = time.monotonic()
    # task YAMLs name their data files relative to the repository root
    run = subprocess.run(command, cwd=ROOT, env=offline_environment(scratch, api_key), capture_output=True,
                         text=True, timeout=timeout)
    wall = time.monotonic() - start
    log = run.stdout + run.stderr
    if run.returncode != 0:
        # the server's answers come first (lm-eval logs each failed request's status and body)
        failed = [line for line in log.splitlines() if "API request failed" in line][:3]
        raise RuntimeError(f"lm-eval exited {run.returncode}: {' '.join(command)}\n"
                           + "".join(f"{line[-2000:]}\n" for line in failed) + f"... its output ends:\n{log[-4000:]}")
    found = sorted(out.rglob("results_*.json"))
    if not found:
        raise RuntimeError(f"lm-eval wrote no results under {out}\n{log[-6000:]}")
    results = json.loads(found[-1].read_text())
    each = {name: task_result(results, out, name) for name in tasks}
    single = {"task": tasks[0], **each[tasks[0]]} if isinstance(task, str) else {}
    return {**single, "tasks": each, "model_type": model_type, "results": results, "command": command,
            "wall_s": wall, "log": log}


def task_result(results: dict[str, Any], out: Path, task: str) -> dict[str, Any]:
    """One task's metrics, item count and logged samples from a run's results under ``out``."""
    samples_files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    samples = [json.loads(line) for line in samples_files[-1].read_text().splitlines()] if samples_files else []
    metrics = {key.split(",")[0]: value for key, value in results["results"][task].items()
               if "," in key and "_stderr" not in key}  # "acc,none": metric "acc", filter "none"
    return {"metrics": metrics, "n": results["n-samples"][task]["effective"], "samples": samples}
