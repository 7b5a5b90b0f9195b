"""Building a vLLM engine that serves with the plugin, and requests for it.

``engine_kwargs`` is the one place that configures vLLM for the plugin: the architecture
override, the engine's default settings (in the model config, passed down to every worker),
the served maximum length, the request-settings tracker, and the CPU cores the worker uses.
"""

from __future__ import annotations

import os
from typing import Any

from vllm import SamplingParams

from .requests import ARCHITECTURE, CONFIG_KEY, EXTRA_ARGS_KEY, RequestSettingsTracker, salted_prompt
from .settings import ExtensionSettings, parse_settings


def checkpoint_train_length(model: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).max_position_embeddings)


# vLLM's CPU workers keep one core per worker free for the scheduler process, which mostly
# waits for the step to finish. Above this many cores that costs little; at 2 it is half the machine.
FEW_CORES = 4
RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def compute_on_every_core() -> None:
    """Let the CPU worker's threads use every core on a small machine (vLLM reads this in the
    engine process, which inherits the environment); a value the user set is kept."""
    if len(os.sched_getaffinity(0)) <= FEW_CORES:
        os.environ.setdefault(RESERVED_CORES_ENV, "0")


def engine_kwargs(model: str, *, defaults: dict[str, Any] | None = None, max_model_len: int | None = None,
                  **engine: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` serving ``model`` with the plugin.

    ``defaults`` are the engine's extension settings (fields of ExtensionSettings), which
    requests override. Serving past the checkpoint's ``max_position_embeddings`` needs an
    extension method among the defaults. On a machine with few cores it also lets the
    worker compute on all of them (:func:`compute_on_every_core`).
    """
    compute_on_every_core()
    train_length = checkpoint_train_length(model)
    settings = parse_settings(defaults, ExtensionSettings(train_length=train_length))
    served = max_model_len or train_length
    if served > train_length and settings.is_plain_rope:
        raise ValueError(
            f"max_model_len {served} is past the checkpoint's training length {train_length}: "
            "choose a default extension method (defaults={'method': ...})")
    overrides = dict(engine.pop("hf_overrides", None) or {})
    overrides.update({
        "architectures": [ARCHITECTURE],
        CONFIG_KEY: settings.model_dump(),
        "max_position_embeddings": max(served, train_length),
    })
    processors = [RequestSettingsTracker, *(engine.pop("logits_processors", None) or [])]
    return dict(model=model, hf_overrides=overrides, max_model_len=served, logits_processors=processors, **engine)


def extension_request(prompt: dict[str, Any], params: SamplingParams, fields: dict[str, Any] | None,
                      defaults: ExtensionSettings) -> tuple[dict[str, Any], SamplingParams, ExtensionSettings]:
    """A request under ``defaults`` overridden by ``fields``: validated completely (raises
    SettingsError), the prompt salted for the prefix cache, the settings in ``extra_args``."""
    settings = parse_settings(fields, defaults)
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: settings.model_dump()}
    return salted_prompt(prompt, settings), params, settings
