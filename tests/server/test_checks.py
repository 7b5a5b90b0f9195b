"""This server's checks as pure functions (server/checks.py): a rendered request within its
bounds, each prompt's settings resolved, and every refusal an error of the catalogue naming its
field. No engine: vLLM's request is stood in for by the fields the checks read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.server.checks import Bounds, check_rendered, check_text_length
from rope_plugins.server.config import parse_config
from rope_plugins.server.errors import APIError
from rope_plugins.server.extension import ServerDefaults, attach_extension, engine_default_fields
from rope_plugins.server.schemas import ContextExtension

TRAIN, SERVED = 64, 256
BOUNDS = Bounds(served=SERVED, vocabulary=100, longest_token_chars=10, max_logprob_entries=1000)


def defaults() -> ServerDefaults:
    config = parse_config(["--max-model-len", str(SERVED)], environ={})
    return ServerDefaults.of(config, ExtensionSettings.model_validate({**engine_default_fields(config),
                                                                       "train_length": TRAIN}))


def completion(max_tokens=4, logprobs=None, extension=None):
    request = SimpleNamespace(prompt="", echo=False, n=1, max_tokens=max_tokens, min_tokens=0, logprobs=logprobs,
                              prompt_logprobs=None)
    attach_extension(request, None if extension is None else ContextExtension.model_validate(extension))
    return request


def prompts(*lengths: int) -> list[dict]:
    return [{"prompt_token_ids": [1] * length} for length in lengths]


def refusal(request, engine_inputs) -> APIError:
    with pytest.raises(APIError) as refused:
        check_rendered(request, engine_inputs, "prompt", BOUNDS, defaults())
    return refused.value


def test_each_prompt_is_resolved_for_the_positions_it_occupies():
    applied, max_tokens = check_rendered(completion(), prompts(10, 100, 200), "prompt", BOUNDS, defaults())
    assert max_tokens == 4
    assert [settings.method for settings in applied] == ["none", "leaky_rerope", "rerope"]  # auto, by band


@pytest.mark.parametrize("request_, engine_inputs, status, param, code", [
    (completion(), prompts(0), 400, "prompt", None),
    (completion(), prompts(SERVED), 400, "prompt", "context_length_exceeded"),
    (completion(max_tokens=SERVED), prompts(10), 400, "max_tokens", "context_length_exceeded"),
    (completion(), [{"prompt_token_ids": [100]}], 400, "prompt", None),
    (completion(logprobs=300), prompts(10), 400, "logprobs", None),
    (completion(extension={"method": "rerope", "window": TRAIN}), prompts(10), 400, "context_extension.window",
     "invalid_context_extension"),
])
def test_a_request_past_a_bound_is_refused_naming_its_field(request_, engine_inputs, status, param, code):
    refused = refusal(request_, engine_inputs)
    assert (refused.status, refused.param, refused.code) == (status, param, code)


def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized():
    check_text_length(SERVED * 10, BOUNDS, "prompt")
    with pytest.raises(APIError) as refused:
        check_text_length(SERVED * 10 + 1, BOUNDS, "prompt")
    assert refused.value.code == "context_length_exceeded"
