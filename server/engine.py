"""The engine behind the HTTP surface: vLLM's ``AsyncLLM`` with the plugin, its lifecycle, the
tokenizer, and the measured generation. It knows no HTTP: the checks are pure functions
(:mod:`rope_plugins.server.checks`), the settings are resolved by one function
(:mod:`rope_plugins.server.extension`), admission is :mod:`rope_plugins.server.admission`.

vLLM's serving classes (:mod:`rope_plugins.server.vllm_handlers`) render each request; before
anything reaches the engine, every prompt is held to this server's bounds and its settings are
resolved. :class:`ExtensionEngine` then gives each engine request those settings (in its
``extra_args``, its prefix-cache salt) and measures it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from vllm import envs as vllm_envs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from rope_plugins.frontend.engine_args import default_settings, engine_kwargs, extension_request
from rope_plugins.rules.checkpoint import CheckpointRotary, checkpoint_rotary
from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.server.checks import Bounds
from rope_plugins.server.config import AUTO, ServerConfig, served_dtype
from rope_plugins.server.errors import bad_request, engine_unavailable, printable
from rope_plugins.server.extension import EXTENSION_KEY, ServerDefaults, engine_default_fields
from rope_plugins.server.grammars import GrammarCheck
from rope_plugins.server.metrics import Metrics

logger = logging.getLogger(__name__)


class ExtensionEngine(AsyncLLM):
    """vLLM's ``AsyncLLM``, giving each request the settings its prompt resolves to (its
    ``extra_args``, a prefix-cache salt of its own) and measuring it: latency metrics by
    method and one log line when it ends."""

    service: EngineService  # set once built

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        prompt = dict(prompt)
        settings = prompt.pop(EXTENSION_KEY)  # resolved when the request was rendered (checks.check_rendered)
        prompt_ids = prompt["prompt_token_ids"]
        prompt, params = extension_request(prompt, sampling_params, settings)
        outputs = super().generate(prompt, params, request_id, *args, **kwargs)
        logged_text = prompt.get("prompt") if self.service.config.log_prompts else None
        async for output in measure_outputs(self.service, request_id, settings, len(prompt_ids), params, outputs,
                                     logged_text):
            yield output


async def measure_outputs(service: EngineService, request_id: str, settings: ExtensionSettings,
                          prompt_tokens: int, params: Any, outputs: AsyncIterator[Any],
                          prompt_text: str | None = None) -> AsyncIterator[Any]:
    """The engine outputs of one request, measured: time to first token, between tokens
    (streamed requests), end to end, token counts by method; one log line when it ends,
    however it ends."""
    metrics, method = service.metrics, settings.method + ("+log_n" if settings.log_n else "")
    arrival = time.perf_counter()
    streamed = params.output_kind == RequestOutputKind.DELTA
    first = last = None
    generated, outcome, finish, reason = 0, "error", None, ""
    try:
        async for output in outputs:
            now = time.perf_counter()
            new = sum(len(choice.token_ids) for choice in output.outputs)
            if new and first is None:
                # collected answers come once, at the end: their first token is the engine's own measure
                stats = getattr(output, "metrics", None)
                first = now if streamed or stats is None else arrival + stats.first_token_latency
                metrics.time_to_first_token.labels(method).observe(first - arrival)
            elif new and streamed and last is not None:
                for _ in range(new):
                    metrics.inter_token_latency.labels(method).observe((now - last) / new)
            last = now if new else last
            generated = new + (generated if streamed else 0)
            finish = ",".join(sorted({c.finish_reason for c in output.outputs if c.finish_reason})) or finish
            yield output
        outcome = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "aborted"
        raise
    except Exception as error:
        reason = f" error={type(error).__name__}:{printable(str(error))[:200]!r}"
        raise
    finally:
        elapsed = time.perf_counter() - arrival
        metrics.requests.labels(method, outcome).inc()
        metrics.prompt_tokens.labels(method).inc(prompt_tokens)
        metrics.generation_tokens.labels(method).inc(generated)
        if outcome == "ok":
            metrics.end_to_end_latency.labels(method).observe(elapsed)
        ttft = f"{first - arrival:.2f}s" if first is not None else "-"
        logger.log(logging.WARNING if outcome == "error" else logging.INFO,
                   "%s %s settings=%s prompt=%d completion=%d ttft=%s e2e=%.2fs finish=%s%s%s", request_id, outcome,
                   json.dumps(settings.canonical(), separators=(",", ":")), prompt_tokens, generated, ttft, elapsed,
                   finish or "-", reason, f" prompt_text={prompt_text!r}" if prompt_text is not None else "")


class EngineService:
    """The engine's lifecycle (start, health, shutdown), tokenizing, and what the checks and the
    settings need to know of it, once it is up (:attr:`bounds`, :attr:`defaults`)."""

    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self.engine = None
        self.tokenizer = None
        # what a request that names no settings runs in the engine; the base of every request's
        self.engine_default: ExtensionSettings | None = None
        self.defaults: ServerDefaults | None = None  # what a request's unset fields take
        self.bounds: Bounds | None = None
        self.rotary: CheckpointRotary | None = None  # the checkpoint's own (full-attention layers')
        self.model_path = ""
        self.model_name = config.served_model_name or ""
        self.created = int(time.time())
        self.state = "starting"  # starting, ready, failed, stopping
        self.failure: str | None = None
        self.openai = None  # vLLM's serving classes around the engine (server.vllm_handlers)
        self.grammars: GrammarCheck | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    def engine_args(self, model: str):
        from vllm.engine.arg_utils import AsyncEngineArgs

        config = self.config
        dtype = served_dtype(config.dtype)
        if dtype != config.dtype:
            logger.info("dtype %s: serving %s", config.dtype, dtype)
        kwargs = engine_kwargs(
            model, defaults=self.engine_default, max_model_len=config.max_model_len, dtype=dtype,
            attention_precision=config.attention_precision,
            kv_cache_memory_bytes=config.kv_cache_memory, kv_cache_dtype=config.kv_cache_dtype,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            enforce_eager=config.enforce_eager, served_model_name=self.model_name or None, seed=0,
            tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend)
        # generation_config "vllm": a request's defaults are the OpenAI API's, not the checkpoint's
        return AsyncEngineArgs(**kwargs, disable_log_stats=False, enable_log_requests=False, generation_config="vllm")

    async def start(self, model: str) -> None:
        from rope_plugins.server.vllm_handlers import build_openai_serving

        try:
            self.model_path = model
            self.model_name = self.model_name or Path(model).name
            began = time.perf_counter()
            logger.info("starting the engine for %s (max context %d tokens; a first start compiles the model, "
                        "minutes on a small CPU, and later starts reuse it)", model, self.config.max_model_len)
            self.engine_default = default_settings(model, engine_default_fields(self.config))
            self.defaults = ServerDefaults.of(self.config, self.engine_default)
            args = self.engine_args(model)
            self.engine = await asyncio.to_thread(
                ExtensionEngine.from_engine_args, args, stat_loggers=[self.metrics.stat_logger_factory()])
            self.engine.service = self
            self.tokenizer = self.engine.get_tokenizer()
            self.bounds = Bounds(served=self.config.max_model_len, vocabulary=self.engine.model_config.get_vocab_size(),
                                 longest_token_chars=max(len(token) for token in self.tokenizer.get_vocab()),
                                 max_logprob_entries=self.config.max_logprob_entries)
            self.rotary = checkpoint_rotary(self.engine.vllm_config.model_config.hf_config)
            self.grammars = GrammarCheck(self.engine.vllm_config, self.engine.tokenizer, self.bounds.vocabulary,
                                         bound=float(vllm_envs.VLLM_REGEX_COMPILATION_TIMEOUT_S))
            self.openai = await build_openai_serving(self, self.tool_parser())
            self.state = "ready"
            self.log_ready(time.perf_counter() - began)
        except Exception as error:
            self.state, self.failure = "failed", f"{type(error).__name__}: {error}"
            logger.exception("the engine failed to start")

    def log_ready(self, seconds: float) -> None:
        config, auto = self.config, ""
        if config.method == AUTO:
            auto = "; auto past training: " + (
                f"{config.auto_method}{' with log_n' if self.defaults.auto_log_n else ''}"
                if config.auto_method else "the evaluated rule (server/auto.py)")
        logger.info("engine ready in %.0f s: model %r, trained at %d tokens, serving up to %d; default "
                    "extension %s%s; KV cache %s: %d tokens of %d bytes", seconds, self.model_name, self.train_length,
                    config.max_model_len, config.extension_defaults(), auto, config.kv_cache_dtype,
                    self.kv_cache_tokens, self.kv_cache_bytes_per_token)

    def shutdown(self) -> None:
        if self.state != "failed":  # a failed engine stays failed: the exit status says so
            self.state = "stopping"
        if self.engine is not None:
            self.engine.shutdown()

    def tool_parser(self) -> str | None:
        return None if self.config.tool_call_parser == "none" else self.config.tool_call_parser

    @property
    def kv_cache_tokens(self) -> int:
        """The tokens the engine's KV cache holds (0 before it is up)."""
        cache = self.engine.vllm_config.cache_config if self.engine is not None else None
        return (cache.num_gpu_blocks or 0) * cache.block_size if cache is not None else 0

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """--kv-cache-memory over the tokens it holds (what whole blocks leave over included)."""
        return self.config.kv_cache_memory // max(1, self.kv_cache_tokens)

    @property
    def train_length(self) -> int:
        return self.engine_default.train_length if self.engine_default else 0

    def health(self) -> tuple[bool, str]:
        if self.state == "ready" and self.engine is not None and self.engine.errored:
            self.state, self.failure = "failed", f"engine died: {self.engine.dead_error}"
        if self.state == "ready":
            return True, "ok"
        return False, self.failure or self.state

    def require_ready(self) -> None:
        healthy, reason = self.health()
        if not healthy:
            raise engine_unavailable(reason)

    # ---- tokenizing and the engine's own checks ----------------------------------------

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, for /tokenize: counting the tokens of a long text is its use, so
        no length bound here (the body limit and admission bound its cost)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, for /tokenize."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # a template that refuses the conversation (e.g. role order)
            raise bad_request(f"messages: the chat template refused them: {error}", param="messages") from None
        return self.encode_text(text, add_special_tokens=False)

    async def verify_sampling(self, request: Any, max_tokens: int) -> None:
        """vLLM's own checks of a request's sampling (its grammar's syntax, its token ids in the
        vocabulary), as the engine will run them on admission, then its grammar compiled and
        tried as the engine's first step will (:mod:`rope_plugins.server.grammars`): here they run
        before a stream starts, so that a refusal is a 400 rather than an event after the 200
        (raises vLLM's VLLMValidationError)."""
        config = self.engine.vllm_config
        params = request.to_sampling_params(max_tokens, {})
        params.verify(config.model_config, config.speculative_config, config.structured_outputs_config,
                      self.engine.tokenizer)
        await self.grammars.check(params)
