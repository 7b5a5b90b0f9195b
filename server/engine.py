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

from rope_plugins.engine import engine_kwargs, extension_request
from rope_plugins.requests import engine_defaults
from rope_plugins.settings import ExtensionSettings, SettingsError, parse_settings

from .config import AUTO, ServerConfig
from .errors import APIError, bad_request, engine_unavailable, server_full
from .metrics import Metrics
from .schemas import SamplingFields

logger = logging.getLogger(__name__)

# vLLM's parameter names, as the API calls them
API_PARAMS = {"extra_args": "context_extension", "prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}


@dataclass
class Job:
    """One engine request: a prompt's token ids, its sampling, and its resolved settings."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    settings: ExtensionSettings
    engine_prompt: dict[str, Any] = field(default_factory=dict)

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
        engine_default = {k: v for k, v in config.extension_defaults().items() if k != "method"}
        engine_default["method"] = config.auto_method if config.method == AUTO else config.method
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
            self.state = "ready"
            config = self.config
            auto = (f"; auto past training: {config.auto_method}"
                    f"{' with log_n' if config.auto_log_n_past_training else ''}" if config.method == AUTO else "")
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
            raise APIError(400, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_text_length(self, characters: int, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit: no token covers more than
        ``longest_token_chars`` characters, so it has at least characters / that many tokens."""
        served = self.config.max_model_len
        if characters > served * self.longest_token_chars:
            raise bad_request(f"{param}: the text has {characters} characters, so more than {served} tokens, this "
                              f"server's maximum context", param=param, code="context_length_exceeded")

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
        """The request's settings: server defaults overridden by ``fields``; ``auto`` becomes
        plain RoPE while prompt + completion fit the training length, ``auto_method`` beyond
        (with log-n query scaling under ``auto_log_n``, unless the request sets ``log_n``)."""
        merged = {**self.config.extension_defaults(), **fields}
        if merged.get("method") == AUTO:
            train_length = merged.get("train_length", self.train_length)
            fits = isinstance(train_length, int) and prompt_tokens + max_tokens <= train_length
            merged["method"] = "none" if fits else self.config.auto_method
            if not fits and "log_n" not in fields:
                merged["log_n"] = self.config.auto_log_n_past_training
        try:
            settings = parse_settings(merged, self.defaults)
            longest = max(self.config.max_model_len, self.train_length)
            if settings.train_length > longest:
                raise SettingsError("train_length", f"must be at most {longest} (the longer of the served context "
                                                    f"and the checkpoint's training length), got {settings.train_length}")
            return settings
        except SettingsError as error:
            param = f"context_extension.{error.field}" if error.field else "context_extension"
            raise bad_request(str(error), param=param, code="invalid_context_extension") from None

    def build_jobs(self, prompts: list[list[int]], body: SamplingFields, request_id: str, *, prompt_param: str,
                   logprobs: int | None = None, prompt_logprobs: int | None = None,
                   logprobs_param: str = "logprobs") -> list[Job]:
        """Validated engine requests, one per prompt; raises APIError (400) on bad input."""
        served = self.config.max_model_len
        jobs = []
        logprob_entries = 0
        fields = body.context_extension.fields() if body.context_extension else {}
        for index, prompt_ids in enumerate(prompts):
            if not prompt_ids:
                raise bad_request(f"{prompt_param}: the prompt is empty", param=prompt_param)
            if len(prompt_ids) >= served:
                raise bad_request(
                    f"{prompt_param}: the prompt has {len(prompt_ids)} tokens; this server's maximum context is "
                    f"{served} tokens (prompt + completion)", param=prompt_param, code="context_length_exceeded")
            max_tokens = body.max_tokens if body.max_tokens is not None else served - len(prompt_ids)
            if len(prompt_ids) + max_tokens > served:
                raise bad_request(
                    f"max_tokens: the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, "
                    f"{len(prompt_ids) + max_tokens} in all; this server's maximum context is {served} tokens",
                    param="max_tokens", code="context_length_exceeded")
            if body.min_tokens > max_tokens:
                raise bad_request(f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})",
                                  param="min_tokens")
            vocabulary = self.engine.vllm_config.model_config.get_vocab_size()
            if any(not 0 <= t < vocabulary for t in prompt_ids):
                raise bad_request(f"{prompt_param}: token ids must be in [0, {vocabulary})", param=prompt_param)
            if logprobs is not None:
                logprob_entries += body.n * max_tokens * (logprobs + 1)
            if prompt_logprobs is not None:
                logprob_entries += len(prompt_ids) * (prompt_logprobs + 1)
            if logprob_entries > self.config.max_logprob_entries:
                raise bad_request(
                    f"{logprobs_param}: this request asks for {logprob_entries} log-probabilities or more "
                    f"(positions x choices x (top + 1)); the limit is {self.config.max_logprob_entries}: lower max_tokens, n or "
                    f"{logprobs_param}", param=logprobs_param)
            settings = self.resolve_settings(fields, len(prompt_ids), max_tokens)
            params = self.sampling_params(body, max_tokens, logprobs, prompt_logprobs)
            # settings are resolved and validated above: no fields left to override them
            prompt, params, settings = extension_request({"prompt_token_ids": prompt_ids}, params, None, settings)
            jobs.append(Job(f"{request_id}-{index}", prompt_ids, params, settings, prompt))
        return jobs

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
            raise bad_request(f"{param}: this request needs {count} sequences (prompts x n); this server holds at "
                              f"most {self.capacity} at once", param=param, code="request_too_large")
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


def engine_refusal(error: Exception) -> APIError:
    """vLLM's refusal of a sampling value, as a 400 naming the API's field (vLLM names it, or
    its message starts with it: "n must be 1 when using greedy sampling")."""
    param = getattr(error, "parameter", None)
    if not param:
        first_word = str(error).split(" ", 1)[0]
        param = first_word if first_word in SamplingFields.model_fields else None
    param = API_PARAMS.get(param, param) if param else None
    return bad_request(f"{param}: {error}" if param else str(error), param=param)
