"""The engine behind the HTTP surface: vLLM's ``AsyncLLM`` with the plugin, the tokenizer,
the per-request settings (``auto`` resolved here), admission, and the measured generation.

vLLM's serving classes (:mod:`server.openai_serving`) render each request; before anything
reaches the engine, :meth:`EngineService.check_rendered` holds every prompt to this server's
bounds and resolves its settings, so bad input is a 400 and never reaches, or disturbs, the
running batch. :class:`ExtensionEngine` then gives each engine request those settings (in its
``extra_args``, its prefix-cache salt) and measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from rope_plugins.frontend.engine_args import engine_kwargs, extension_request
from rope_plugins.rules.checkpoint import CheckpointRotary, checkpoint_rotary
from rope_plugins.rules.settings import (
    ExtensionSettings,
    SettingsError,
    engine_defaults,
    is_train_length,
    parse_settings,
    positions_used,
    with_factor_resolved,
)
from rope_plugins.server.auto import auto_settings
from rope_plugins.server.config import AUTO, ServerConfig
from rope_plugins.server.errors import (
    bad_request,
    context_length_exceeded,
    engine_unavailable,
    invalid_settings,
    model_not_found,
    printable,
    request_too_large,
    server_full,
)
from rope_plugins.server.metrics import Metrics

logger = logging.getLogger(__name__)

# A request's own context_extension fields travel to the engine in its vLLM request's
# ``vllm_xargs`` (so in its SamplingParams' ``extra_args``) under this key, until
# ExtensionEngine replaces them by the resolved settings. The route sets it; a client cannot.
REQUESTED_KEY = "rope_extend_requested"
# The vLLM request attribute that holds the settings applied to each of its prompts.
APPLIED_ATTRIBUTE = "rope_extend_applied"


def requested_fields(extra: dict[str, Any] | None) -> dict[str, Any]:
    return dict((extra or {}).get(REQUESTED_KEY) or {})


def applied_settings(request: Any) -> list[ExtensionSettings]:
    """The settings :meth:`EngineService.check_rendered` resolved for each of the request's prompts."""
    return getattr(request, APPLIED_ATTRIBUTE, None) or []


@dataclass(frozen=True)
class RequestAsks:
    """What a vLLM request (chat, completion or Responses) asks for that this server bounds."""

    n: int
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    logprobs_param: str

    @classmethod
    def of(cls, request: Any) -> RequestAsks:
        if hasattr(request, "messages"):  # chat
            return cls(request.n or 1, request.max_completion_tokens or request.max_tokens, request.min_tokens,
                       (request.top_logprobs or 0) if request.logprobs else None, request.prompt_logprobs,
                       "top_logprobs")
        if hasattr(request, "prompt") and hasattr(request, "echo"):  # completions
            echoed = request.logprobs if request.echo and request.logprobs is not None else None
            return cls(request.n or 1, request.max_tokens, request.min_tokens, request.logprobs,
                       request.prompt_logprobs if request.prompt_logprobs is not None else echoed, "logprobs")
        return cls(1, request.max_output_tokens, 0, request.top_logprobs or None, None, "top_logprobs")  # Responses


class ExtensionEngine(AsyncLLM):
    """vLLM's ``AsyncLLM``, giving each request the settings its prompt resolves to (its
    ``extra_args``, a prefix-cache salt of its own) and measuring it: latency metrics by
    method and one log line when it ends."""

    service: EngineService  # set once built

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        extra = dict(sampling_params.extra_args or {})
        fields = requested_fields(extra)
        extra.pop(REQUESTED_KEY, None)
        prompt_ids = prompt["prompt_token_ids"]
        # checked when the request was rendered (EngineService.check_rendered): cannot fail here
        settings = self.service.resolve_settings(fields, len(prompt_ids), sampling_params.max_tokens)
        params = sampling_params.clone()
        params.extra_args = extra or None
        prompt, params, settings = extension_request(prompt, params, None, settings)
        outputs = super().generate(prompt, params, request_id, *args, **kwargs)
        logged_text = prompt.get("prompt") if self.service.config.log_prompts else None
        async for output in measured(self.service, request_id, settings, len(prompt_ids), params, outputs,
                                     logged_text):
            yield output


async def measured(service: EngineService, request_id: str, settings: ExtensionSettings, prompt_tokens: int,
                   params: Any, outputs: AsyncIterator[Any], prompt_text: str | None = None) -> AsyncIterator[Any]:
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


class Admission:
    """A request's claim on ``count`` sequences of the server's capacity, from before its
    prompt is tokenized until its answer is done."""

    def __init__(self, service: "EngineService", count: int) -> None:
        self.service, self.count = service, count

    def release(self) -> None:
        if self.count:
            self.service.in_flight -= self.count
            self.service.metrics.in_flight.set(self.service.in_flight)
            self.count = 0

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[None]:
        """Until the answer takes the claim over: any failure gives it back."""
        try:
            yield
        except BaseException:
            self.release()
            raise


class EngineService:
    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config, self.metrics = config, metrics
        self.engine = None
        self.tokenizer = None
        self.defaults: ExtensionSettings | None = None
        self.rotary: CheckpointRotary | None = None  # the checkpoint's own (full-attention layers')
        self.model_path = ""
        self.model_name = config.served_model_name or ""
        self.created = int(time.time())
        self.state = "starting"  # starting, ready, failed, stopping
        self.failure: str | None = None
        self.in_flight = 0
        self.capacity = config.max_num_seqs + config.max_waiting
        self.longest_token_chars = 0  # the vocabulary's longest token: bounds a text's tokens from below
        self.openai = None  # vLLM's serving classes around the engine (server.openai_serving)

    # ---- lifecycle ---------------------------------------------------------------------

    def engine_args(self, model: str):
        from vllm.engine.arg_utils import AsyncEngineArgs

        config = self.config
        # the engine's own default factor stays a number: the server resolves 'auto' for every request
        engine_default = {k: v for k, v in config.extension_defaults().items()
                          if k != "method" and not (k == "factor" and v == AUTO)}
        engine_default["method"] = (config.auto_method or "rerope") if config.method == AUTO else config.method
        if engine_default["method"] in ("none",) and not config.log_n:
            engine_default["method"] = "rerope"  # the engine serves past the training length; requests choose
        kwargs = engine_kwargs(
            model, defaults=engine_default, max_model_len=config.max_model_len, dtype=config.dtype,
            kv_cache_memory_bytes=config.kv_cache_memory, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            enforce_eager=config.enforce_eager, served_model_name=self.model_name or None, seed=0,
            tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend)
        # generation_config "vllm": a request's defaults are the OpenAI API's, not the checkpoint's
        return AsyncEngineArgs(**kwargs, disable_log_stats=False, enable_log_requests=False, generation_config="vllm")

    async def start(self, model: str) -> None:
        from rope_plugins.server.openai_serving import build_openai_serving

        try:
            self.model_path = model
            self.model_name = self.model_name or Path(model).name
            began = time.perf_counter()
            logger.info("starting the engine for %s (max context %d tokens)", model, self.config.max_model_len)
            args = self.engine_args(model)
            self.engine = await asyncio.to_thread(
                ExtensionEngine.from_engine_args, args, stat_loggers=[self.metrics.stat_logger_factory()])
            self.engine.service = self
            self.tokenizer = self.engine.get_tokenizer()
            self.longest_token_chars = max(len(token) for token in self.tokenizer.get_vocab())
            hf_config = self.engine.vllm_config.model_config.hf_config
            self.defaults = engine_defaults(hf_config)
            self.rotary = checkpoint_rotary(hf_config)
            self.openai = await build_openai_serving(self, self.tool_parser())
            self.state = "ready"
            config = self.config
            auto = ""
            if config.method == AUTO:
                auto = "; auto past training: " + (
                    f"{config.auto_method}{' with log_n' if config.auto_log_n_past_training else ''}"
                    if config.auto_method else "the evaluated rule (server/auto.py)")
            logger.info("engine ready in %.0f s: model %r, trained at %d tokens, serving up to %d; default "
                        "extension %s%s", time.perf_counter() - began, self.model_name, self.defaults.train_length,
                        config.max_model_len, config.extension_defaults(), auto)
        except Exception as error:
            self.state, self.failure = "failed", f"{type(error).__name__}: {error}"
            logger.exception("the engine failed to start")

    def shutdown(self) -> None:
        if self.state != "failed":  # a failed engine stays failed: the exit status says so
            self.state = "stopping"
        if self.engine is not None:
            self.engine.shutdown()

    def tool_parser(self) -> str | None:
        return None if self.config.tool_call_parser == "none" else self.config.tool_call_parser

    @property
    def train_length(self) -> int:
        return self.defaults.train_length if self.defaults else 0

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

    # ---- requests ----------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.model_path):
            raise model_not_found(name, self.model_name)

    def check_text_length(self, characters: int, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit: no token covers more than
        ``longest_token_chars`` characters, so it has at least characters / that many tokens."""
        served = self.config.max_model_len
        if characters > served * self.longest_token_chars:
            raise context_length_exceeded(f"{param}: the text has {characters} characters, so more than {served} "
                                          f"tokens, this server's maximum context", param)

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

    def resolve_settings(self, fields: dict[str, Any], prompt_tokens: int, max_tokens: int) -> ExtensionSettings:
        """The request's settings: server defaults overridden by ``fields``. ``auto`` is
        :func:`auto_settings` for the positions the request occupies (:func:`positions_used`),
        or past the training length ``--auto-method`` at its defaults (log-n under
        ``--auto-log-n``); the fields the request sets itself stay. A ``factor`` of ``auto``
        becomes what those positions need (:func:`length_factor`)."""
        merged = {**self.config.extension_defaults(), **fields}
        positions = positions_used(prompt_tokens, max_tokens)
        merged = with_factor_resolved(merged, positions, self.defaults)
        if merged.get("method") == AUTO:
            train_length = merged.get("train_length", self.train_length)
            if not is_train_length(train_length):
                chosen = {"method": self.config.auto_method or "none"}  # train_length's own error comes next
            elif positions <= train_length or self.config.auto_method is None:
                chosen = auto_settings(positions, train_length)
            else:
                chosen = {"method": self.config.auto_method, "log_n": self.config.auto_log_n_past_training}
            merged.update({name: value for name, value in chosen.items() if name == "method" or name not in fields})
        try:
            settings = parse_settings(merged, self.defaults)
            longest = max(self.config.max_model_len, self.train_length)
            if settings.train_length > longest:
                raise SettingsError("train_length", f"must be at most {longest} (the longer of the served context "
                                                    f"and the checkpoint's training length), got {settings.train_length}")
            return settings
        except SettingsError as error:
            raise invalid_settings(str(error), error.field) from None

    def check_prompt_length(self, prompt_ids: list[int], param: str) -> None:
        """At least one token, and room for one more in the served context."""
        served = self.config.max_model_len
        if not prompt_ids:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        if len(prompt_ids) >= served:
            raise context_length_exceeded(f"{param}: the prompt has {len(prompt_ids)} tokens; this server's maximum "
                                          f"context is {served} tokens (prompt + completion)", param)

    def completion_limit(self, prompt_tokens: int, requested: int | None, min_tokens: int) -> int:
        """The request's max_tokens (by default the rest of the served context), checked to fit
        with the prompt and to allow min_tokens."""
        served = self.config.max_model_len
        max_tokens = requested if requested is not None else served - prompt_tokens
        if prompt_tokens + max_tokens > served:
            raise context_length_exceeded(
                f"max_tokens: the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                f"{prompt_tokens + max_tokens} in all; this server's maximum context is {served} tokens", "max_tokens")
        if min_tokens > max_tokens:
            raise bad_request(f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
        return max_tokens

    def check_rendered(self, request: Any, engine_inputs: list[Any], prompt_param: str) -> None:
        """A rendered request (vLLM's request model, its prompts' engine inputs) within this
        server's bounds, and each prompt's settings resolved (raises APIError, 400). The applied
        settings are kept on the request (:func:`applied_settings`) for the response to report."""
        fields = requested_fields(getattr(request, "vllm_xargs", None))
        ask = RequestAsks.of(request)
        applied, entries = [], 0
        for engine_input in engine_inputs:
            prompt_ids = list(engine_input.get("prompt_token_ids") or [])
            self.check_prompt_length(prompt_ids, prompt_param)
            self.check_token_ids(prompt_ids, prompt_param)
            max_tokens = self.completion_limit(len(prompt_ids), ask.max_tokens, ask.min_tokens)
            entries += logprob_entries(ask.n, max_tokens, len(prompt_ids), ask.logprobs, ask.prompt_logprobs)
            self.check_logprob_budget(entries, ask.logprobs_param)
            applied.append(self.resolve_settings(fields, len(prompt_ids), max_tokens))
        if engine_inputs:
            self.check_sampling(request, max_tokens)
        setattr(request, APPLIED_ATTRIBUTE, applied)

    def check_sampling(self, request: Any, max_tokens: int) -> None:
        """vLLM's own checks of a request's sampling (its grammar compiled, its token ids in the
        vocabulary), as the engine will run them on admission: here they run before a stream
        starts, so that a refusal is a 400 rather than an event after the 200 (raises vLLM's
        VLLMValidationError)."""
        config = self.engine.vllm_config
        params = request.to_sampling_params(max_tokens, {})
        params.verify(config.model_config, config.speculative_config, config.structured_outputs_config,
                      self.engine.tokenizer)

    def check_token_ids(self, prompt_ids: list[int], param: str) -> None:
        vocabulary = self.engine.model_config.get_vocab_size()
        if any(not 0 <= t < vocabulary for t in prompt_ids):
            raise bad_request(f"{param}: token ids must be in [0, {vocabulary})", param=param)

    def check_logprob_budget(self, entries: int, param: str) -> None:
        """A request's log-probabilities (all its prompts') within ``--max-logprob-entries``."""
        limit = self.config.max_logprob_entries
        if entries > limit:
            raise bad_request(f"{param}: this request asks for {entries} log-probabilities or more (positions x "
                              f"choices x (top + 1)); the limit is {limit}: lower max_tokens, n or {param}", param=param)

    def admit(self, count: int, param: str) -> "Admission":
        """Bounded admission of ``count`` sequences (prompts x n): beyond the running + waiting
        capacity, 429 with Retry-After; a request that could never fit, 400 naming ``param``.
        Release the returned ticket when the request is done (idempotent)."""
        if count > self.capacity:
            raise request_too_large(param, count, self.capacity)
        if self.in_flight + count > self.capacity:
            raise server_full(self.in_flight, self.capacity)
        self.in_flight += count
        self.metrics.in_flight.set(self.in_flight)
        return Admission(self, count)

def logprob_entries(n: int, max_tokens: int, prompt_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> int:
    """How many log-probabilities one prompt's job may return: positions x choices x (top + 1)."""
    entries = 0
    if logprobs is not None:
        entries += n * max_tokens * (logprobs + 1)
    if prompt_logprobs is not None:
        entries += prompt_tokens * (prompt_logprobs + 1)
    return entries
