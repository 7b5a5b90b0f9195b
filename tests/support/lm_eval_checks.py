"""EleutherAI's lm-evaluation-harness (``lm-eval``, the bench extra) end to end against a
running server: helpers for the tests, not a test module.

lm-eval runs as a subprocess (its own CLI, ``python -m lm_eval run``:
``rope_plugins/testing/lm_eval_runs.py``) with its OpenAI-compatible API models, on two small
tasks defined in ``tests/support/lm_eval_tasks/`` from local data (no Hugging Face Hub;
``capitals.jsonl``, 28 countries, written by ``make_capitals.py``):

- ``capitals_mc``, loglikelihood: four capitals, which is the country's; ``--model
  local-completions`` (prompt log-probabilities: ``echo`` + ``logprobs`` on ``/v1/completions``;
  lm-eval's chat models have no loglikelihood). Chance is 0.25.
- ``capitals_gen``, generation (``generate_until``): the capital, answered freely; with
  ``--model local-chat-completions`` (``--apply_chat_template``, ``/v1/chat/completions``) or
  ``--model local-completions``. Metrics: ``contains`` (the capital is in the answer) and
  ``exact_match`` (the answer is the capital alone, case and punctuation aside).

Usage, against a server already running (``api_key`` is what the server was started with; lm-eval
reads it from ``OPENAI_API_KEY``)::

    result = run_loglikelihood_task("http://127.0.0.1:8021", "SmolLM2-135M-Instruct", tmp_path,
                                    api_key=API_KEY)
    check_loglikelihood(result)
    result = run_generation_task(base, MODEL, tmp_path, api_key=API_KEY)   # chat by default
    check_generation(result)

What the default model (SmolLM2-135M-Instruct, float32) measured on the whole task:
capitals_mc acc 0.96 (27 of 28; acc_norm 0.75); capitals_gen through chat contains 0.79 (22 of
28; it answers "The capital of France is Paris.", so exact_match 0), through completions
contains 0.96 and exact_match 0.96. The checks' thresholds leave room below those (another dtype,
a changed server default); misaligned prompt log-probabilities or unanswered requests fall far
below them.

``context_extension`` (the server's per-request RoPE extension, a top-level body field) reaches
generation requests through lm-eval's gen_kwargs, which it copies into the request body
(``run_generation_task(..., context_extension={...})`` passes ``--gen_kwargs`` as JSON). lm-eval's
loglikelihood request body is fixed (model, prompt, temperature, max_tokens, logprobs, seed,
echo), so it cannot carry one: start the server with ``--method`` etc. for that.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rope_plugins.testing import lm_eval_runs

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "tests" / "support" / "lm_eval_tasks"
LOGLIKELIHOOD_TASK = "capitals_mc"
GENERATION_TASK = "capitals_gen"
TASK_ITEMS = 28  # lines of tests/support/lm_eval_tasks/capitals.jsonl
CHOICES = 4

# Defaults of the checks (see the module docstring for what was measured).
MIN_LOGLIKELIHOOD_ACC = 0.75  # chance: 0.25
MIN_CONTAINS = {"local-chat-completions": 0.5, "local-completions": 0.75}


def _root_url(base_url: str) -> str:
    """The server's root from "http://host:port", ".../v1" or ".../v1/" alike."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def default_tokenizer() -> Path:
    """The default model's checkpoint directory (its tokenizer; provisioned already when a server
    of it runs)."""
    from rope_plugins.models.provision import provision_default_model

    return provision_default_model()


def run_lm_eval(model_type: str, model_args: dict[str, Any], task: str, tmp_path: Path, *,
                api_key: str | None = None, limit: int | None = None, apply_chat_template: bool = False,
                gen_kwargs: dict[str, Any] | None = None, timeout: float = 600) -> dict[str, Any]:
    """:func:`rope_plugins.testing.lm_eval_runs.run_lm_eval` on one task of tests/support/lm_eval_tasks."""
    return lm_eval_runs.run_lm_eval(model_type, model_args, task, tmp_path, api_key=api_key, timeout=timeout,
                                    include_path=TASKS_DIR, limit=limit, apply_chat_template=apply_chat_template,
                                    gen_kwargs=gen_kwargs)


def run_loglikelihood_task(base_url: str, model: str, tmp_path: Path, *, api_key: str | None = None,
                           limit: int | None = None, num_concurrent: int = 2,
                           tokenizer: str | Path | None = None) -> dict[str, Any]:
    """capitals_mc (28 items x 4 choices = 112 requests to /v1/completions, echo + logprobs) with
    ``--model local-completions``, token-id prompts (lm-eval's default tokenized_requests) from
    the model's own tokenizer (default: the default model's checkpoint). Returns run_lm_eval's
    dict; metrics "acc" and "acc_norm"."""
    model_args = {"model": model, "base_url": f"{_root_url(base_url)}/v1/completions",
                  "tokenizer": tokenizer or default_tokenizer(), "tokenizer_backend": "huggingface",
                  "num_concurrent": num_concurrent}
    return run_lm_eval("local-completions", model_args, LOGLIKELIHOOD_TASK, tmp_path, api_key=api_key, limit=limit)


def run_generation_task(base_url: str, model: str, tmp_path: Path, *, api_key: str | None = None,
                        limit: int | None = None, num_concurrent: int = 2, chat: bool = True,
                        tokenizer: str | Path | None = None,
                        context_extension: dict[str, Any] | None = None) -> dict[str, Any]:
    """capitals_gen (28 items, greedy, at most 16 new tokens, stop at a newline) with ``--model
    local-chat-completions --apply_chat_template`` (chat=True: /v1/chat/completions, the server's
    chat template) or ``--model local-completions`` (chat=False: /v1/completions, token-id
    prompts). ``context_extension`` goes into every request's body (through --gen_kwargs).
    Returns run_lm_eval's dict; metrics "contains" and "exact_match"."""
    root = _root_url(base_url)
    if chat:
        model_type = "local-chat-completions"
        model_args = {"model": model, "base_url": f"{root}/v1/chat/completions", "num_concurrent": num_concurrent}
    else:
        model_type = "local-completions"
        model_args = {"model": model, "base_url": f"{root}/v1/completions",
                      "tokenizer": tokenizer or default_tokenizer(), "tokenizer_backend": "huggingface",
                      "num_concurrent": num_concurrent}
    gen_kwargs = {"context_extension": context_extension} if context_extension is not None else None
    return run_lm_eval(model_type, model_args, GENERATION_TASK, tmp_path, api_key=api_key, limit=limit,
                       apply_chat_template=chat, gen_kwargs=gen_kwargs)


def check_loglikelihood(result: dict[str, Any], *, items: int | None = None,
                        min_acc: float = MIN_LOGLIKELIHOOD_ACC) -> None:
    """Every item evaluated, every choice a finite, negative log-probability, and accuracy well
    above chance (0.25). ``items``: the --limit given (default: the whole task)."""
    expected = items or TASK_ITEMS
    assert result["n"] == expected == len(result["samples"]), (result["n"], len(result["samples"]), expected)
    for sample in result["samples"]:
        logprobs = [float(resp[0][0]) for resp in sample["resps"]]
        assert len(logprobs) == CHOICES and all(math.isfinite(lp) and lp < 0 for lp in logprobs), sample
    acc = result["metrics"]["acc"]
    assert acc >= min_acc, f"acc {acc:.3f} < {min_acc} on {expected} items: {_misses(result, 'acc')}"
    assert 0.0 <= result["metrics"]["acc_norm"] <= 1.0


def check_generation(result: dict[str, Any], *, items: int | None = None,
                     min_contains: float | None = None) -> None:
    """Every item answered (a non-empty text), both metrics computed, and the capital in at least
    ``min_contains`` of the answers (default: 0.5 through chat, 0.75 through completions)."""
    expected = items or TASK_ITEMS
    assert result["n"] == expected == len(result["samples"]), (result["n"], len(result["samples"]), expected)
    empty = [sample["doc"]["question"] for sample in result["samples"] if not sample["resps"][0][0].strip()]
    assert not empty, f"unanswered: {empty}"
    assert {"contains", "exact_match"} <= result["metrics"].keys(), result["metrics"]
    floor = MIN_CONTAINS[result["model_type"]] if min_contains is None else min_contains
    contains = result["metrics"]["contains"]
    assert contains >= floor, f"contains {contains:.3f} < {floor} on {expected} items: {_misses(result, 'contains')}"


def _misses(result: dict[str, Any], metric: str) -> list[tuple[str, Any]]:
    return [(sample["doc"]["question"], sample["resps"]) for sample in result["samples"] if not sample[metric]]
