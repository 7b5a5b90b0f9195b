"""This server's bounds on a request, as pure functions: each takes what it checks and the
bounds it checks against, and raises an error of the catalogue (:mod:`rope_plugins.server.errors`,
which alone knows their HTTP statuses).

:func:`check_rendered` runs on every rendered request before anything reaches the engine: each
prompt's length, its token ids, its completion and log-probabilities within their bounds, and
its settings resolved (:func:`rope_plugins.server.extension.resolve_extension`), so that bad
input never reaches, or disturbs, the running batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rope_plugins.rules.settings import ExtensionSettings, SettingsError, positions_used
from rope_plugins.server.errors import bad_request, context_length_exceeded, invalid_settings, model_not_found
from rope_plugins.server.extension import ServerDefaults, requested_extension, resolve_extension


@dataclass(frozen=True)
class Bounds:
    """What a request is checked against, known once the engine is up."""

    served: int  # the longest prompt + completion, in tokens
    vocabulary: int
    longest_token_chars: int  # the vocabulary's longest token: bounds a text's tokens from below
    max_logprob_entries: int


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


def check_model(name: str, model_name: str, model_path: str) -> None:
    if name not in (model_name, model_path):
        raise model_not_found(name, model_name)


def check_text_length(characters: int, bounds: Bounds, param: str) -> None:
    """Refuse, before tokenizing it, a text that cannot fit: no token covers more than
    ``longest_token_chars`` characters, so it has at least characters / that many tokens."""
    served = bounds.served
    if characters > served * bounds.longest_token_chars:
        raise context_length_exceeded(f"{param}: the text has {characters} characters, so more than {served} "
                                      f"tokens, this server's maximum context", param)


def check_prompt_length(prompt_ids: list[int], served: int, param: str) -> None:
    """At least one token, and room for one more in the served context."""
    if not prompt_ids:
        raise bad_request(f"{param}: the prompt is empty", param=param)
    if len(prompt_ids) >= served:
        raise context_length_exceeded(f"{param}: the prompt has {len(prompt_ids)} tokens; this server's maximum "
                                      f"context is {served} tokens (prompt + completion)", param)


def check_token_ids(prompt_ids: list[int], vocabulary: int, param: str) -> None:
    if any(not 0 <= t < vocabulary for t in prompt_ids):
        raise bad_request(f"{param}: token ids must be in [0, {vocabulary})", param=param)


def completion_limit(prompt_tokens: int, requested: int | None, min_tokens: int, served: int) -> int:
    """The request's max_tokens (by default the rest of the served context), checked to fit
    with the prompt and to allow min_tokens."""
    max_tokens = requested if requested is not None else served - prompt_tokens
    if prompt_tokens + max_tokens > served:
        raise context_length_exceeded(
            f"max_tokens: the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, "
            f"{prompt_tokens + max_tokens} in all; this server's maximum context is {served} tokens", "max_tokens")
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})", param="min_tokens")
    return max_tokens


def logprob_entries(n: int, max_tokens: int, prompt_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> int:
    """How many log-probabilities one prompt's job may return: positions x choices x (top + 1)."""
    entries = 0
    if logprobs is not None:
        entries += n * max_tokens * (logprobs + 1)
    if prompt_logprobs is not None:
        entries += prompt_tokens * (prompt_logprobs + 1)
    return entries


def check_logprob_budget(entries: int, limit: int, param: str) -> None:
    """A request's log-probabilities (all its prompts') within ``--max-logprob-entries``."""
    if entries > limit:
        raise bad_request(f"{param}: this request asks for {entries} log-probabilities or more (positions x "
                          f"choices x (top + 1)); the limit is {limit}: lower max_tokens, n or {param}", param=param)


def prompt_settings(request: Any, prompt_tokens: int, max_tokens: int, defaults: ServerDefaults) -> ExtensionSettings:
    """The settings one prompt of the request runs (:func:`resolve_extension`), a refusal naming the field."""
    try:
        return resolve_extension(requested_extension(request), defaults, positions_used(prompt_tokens, max_tokens))
    except SettingsError as error:
        raise invalid_settings(str(error), error.field) from None


def check_rendered(request: Any, engine_inputs: list[Any], prompt_param: str, bounds: Bounds,
                   defaults: ServerDefaults) -> tuple[list[ExtensionSettings], int | None]:
    """A rendered request (vLLM's request model, its prompts' engine inputs) within this
    server's bounds: each prompt's settings, and the last prompt's max_tokens (None without one)."""
    ask = RequestAsks.of(request)
    applied, entries, max_tokens = [], 0, None
    for engine_input in engine_inputs:
        prompt_ids = list(engine_input.get("prompt_token_ids") or [])
        check_prompt_length(prompt_ids, bounds.served, prompt_param)
        check_token_ids(prompt_ids, bounds.vocabulary, prompt_param)
        max_tokens = completion_limit(len(prompt_ids), ask.max_tokens, ask.min_tokens, bounds.served)
        entries += logprob_entries(ask.n, max_tokens, len(prompt_ids), ask.logprobs, ask.prompt_logprobs)
        check_logprob_budget(entries, bounds.max_logprob_entries, ask.logprobs_param)
        applied.append(prompt_settings(request, len(prompt_ids), max_tokens, defaults))
    return applied, max_tokens
