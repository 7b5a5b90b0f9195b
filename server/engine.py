"""The engine behind the HTTP surface: vLLM's in-process ``AsyncLLM`` with the plugin, the
tokenizer, the per-request settings (``auto`` resolved here), admission, and generation.

Everything a request needs is checked here before it reaches the engine (length, settings,
sampling values), so bad input is a 400 and never reaches, or disturbs, the running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from rope_plugins.checkpoint import CheckpointRotary, checkpoint_rotary
from rope_plugins.engine import engine_kwargs, extension_request
from rope_plugins.settings import (ExtensionSettings, SettingsError, engine_defaults, is_train_length,
                                   parse_settings, positions_used, with_factor_resolved)

from .auto import auto_settings
from .config import AUTO, ServerConfig
from .errors import (bad_request, context_length_exceeded, engine_refusal, engine_unavailable, invalid_settings,
                     model_not_found, request_too_large, server_full)
from .metrics import Metrics
from .schemas import SamplingFields

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One engine request: a prompt's token ids, its sampling, and its resolved settings; the
    ``index``-th prompt of the answer whose id is ``response_id``."""

    response_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    settings: ExtensionSettings
    engine_prompt: dict[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        """The engine's id for this job: its answer's id and its prompt's index."""
        return f"{self.response_id}-{self.index}"

    @property
    def label(self) -> str:
        return self.settings.method + ("+log_n" if self.settings.log_n else "")


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
        return AsyncEngineArgs(**kwargs, disable_log_stats=False, enable_log_requests=False)

    async def start(self, model: str) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self.model_path = model
            self.model_name = self.model_name or Path(model).name
            began = time.perf_counter()
            logger.info("starting the engine for %s (max context %d tokens)", model, self.config.max_model_len)
            args = self.engine_args(model)
            self.engine = await asyncio.to_thread(
                AsyncLLM.from_engine_args, args, stat_loggers=[self.metrics.stat_logger_factory()])
            self.tokenizer = self.engine.get_tokenizer()
            self.longest_token_chars = max(len(token) for token in self.tokenizer.get_vocab())
            hf_config = self.engine.vllm_config.model_config.hf_config
            self.defaults = engine_defaults(hf_config)
            self.rotary = checkpoint_rotary(hf_config)
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

    def encode_text(self, text: str, add_special_tokens: bool = True, param: str | None = "prompt") -> list[int]:
        """Token ids of a prompt; with ``param`` (a generation's prompt) a text that cannot fit
        the served context is refused first. /tokenize passes None: counting the tokens of a
        long text is its use (the body limit and admission bound its cost)."""
        if param is not None:
            self.check_text_length(len(text), param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict[str, str]], bounded: bool = True) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # a template that refuses the conversation (e.g. role order)
            raise bad_request(f"messages: the chat template refused them: {error}", param="messages") from None
        # checked once rendered: the template adds text per message, so many short ones count too
        return self.encode_text(text, add_special_tokens=False, param="messages" if bounded else None)

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

    def build_jobs(self, prompts: list[list[int]], body: SamplingFields, response_id: str, *, prompt_param: str,
                   logprobs: int | None = None, prompt_logprobs: int | None = None,
                   logprobs_param: str = "logprobs") -> list[Job]:
        """Validated engine requests, one per prompt, answering ``response_id``; raises APIError
        (400) on bad input."""
        fields = body.context_extension.fields() if body.context_extension else {}
        jobs, entries = [], 0
        for index, prompt_ids in enumerate(prompts):
            self.check_prompt_length(prompt_ids, prompt_param)
            max_tokens = self.completion_limit(len(prompt_ids), body)
            self.check_token_ids(prompt_ids, prompt_param)
            entries += logprob_entries(body.n, max_tokens, len(prompt_ids), logprobs, prompt_logprobs)
            self.check_logprob_budget(entries, logprobs_param)
            settings = self.resolve_settings(fields, len(prompt_ids), max_tokens)
            params = self.sampling_params(body, max_tokens, logprobs, prompt_logprobs)
            # settings are resolved and validated above: no fields left to override them
            prompt, params, settings = extension_request({"prompt_token_ids": prompt_ids}, params, None, settings)
            jobs.append(Job(response_id, index, prompt_ids, params, settings, prompt))
        return jobs

    def check_prompt_length(self, prompt_ids: list[int], param: str) -> None:
        """At least one token, and room for one more in the served context."""
        served = self.config.max_model_len
        if not prompt_ids:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        if len(prompt_ids) >= served:
            raise context_length_exceeded(f"{param}: the prompt has {len(prompt_ids)} tokens; this server's maximum "
                                          f"context is {served} tokens (prompt + completion)", param)

    def completion_limit(self, prompt_tokens: int, body: SamplingFields) -> int:
        """The request's max_tokens (by default the rest of the served context), checked to fit
        with the prompt and to allow min_tokens."""
        served = self.config.max_model_len
        max_tokens = body.max_tokens if body.max_tokens is not None else served - prompt_tokens
        if prompt_tokens + max_tokens > served:
            raise context_length_exceeded(
                f"max_tokens: the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, "
                f"{prompt_tokens + max_tokens} in all; this server's maximum context is {served} tokens", "max_tokens")
        if body.min_tokens > max_tokens:
            raise bad_request(f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})",
                              param="min_tokens")
        return max_tokens

    def check_token_ids(self, prompt_ids: list[int], param: str) -> None:
        vocabulary = self.engine.vllm_config.model_config.get_vocab_size()
        if any(not 0 <= t < vocabulary for t in prompt_ids):
            raise bad_request(f"{param}: token ids must be in [0, {vocabulary})", param=param)

    def check_logprob_budget(self, entries: int, param: str) -> None:
        """A request's log-probabilities (all its prompts') within ``--max-logprob-entries``."""
        limit = self.config.max_logprob_entries
        if entries > limit:
            raise bad_request(f"{param}: this request asks for {entries} log-probabilities or more (positions x "
                              f"choices x (top + 1)); the limit is {limit}: lower max_tokens, n or {param}", param=param)

    def sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        from vllm.exceptions import VLLMValidationError

        try:
            return SamplingParams(
                n=body.n, temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens,
                stop=body.stop_list() or None, seed=body.seed, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, output_kind=RequestOutputKind.DELTA)
        except (ValueError, VLLMValidationError) as error:  # VLLMValidationError is not a ValueError
            raise engine_refusal(error) from None

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

    async def generate(self, job: Job) -> AsyncIterator[Any]:
        """The engine's outputs (deltas) for one job; an abandoned iteration aborts it in the engine."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            async for output in self.engine.generate(job.engine_prompt, job.params, job.request_id):
                yield output
        except VLLMValidationError as error:
            raise engine_refusal(error) from None
        except EngineDeadError:
            raise engine_unavailable("the engine died while serving this request; the server restarts") from None


def logprob_entries(n: int, max_tokens: int, prompt_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> int:
    """How many log-probabilities one prompt's job may return: positions x choices x (top + 1)."""
    entries = 0
    if logprobs is not None:
        entries += n * max_tokens * (logprobs + 1)
    if prompt_logprobs is not None:
        entries += prompt_tokens * (prompt_logprobs + 1)
    return entries
