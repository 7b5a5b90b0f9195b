"""vLLM's own OpenAI serving classes, mounted behind this app: the one seam to them.

Chat, completions and the Responses API are vLLM's ``OpenAIServingChat``,
``OpenAIServingCompletion`` and ``OpenAIServingResponses`` (its chat templates with tools, tool
parsers, structured outputs, sampling fields, log-probabilities and streaming formats), and
``/detokenize`` is its ``ServingTokenization``. They are built here as vLLM's own
``init_app_state`` builds them, with two of this project's pieces where vLLM leaves a seam:

- the engine client is :class:`rope_plugins.server.engine.ExtensionEngine` (vLLM's ``AsyncLLM``), which gives
  every engine request its resolved ``context_extension`` settings and measures it;
- the renderer is :class:`ExtensionRenderer` (vLLM's ``OnlineRenderer``), which checks each
  rendered prompt against this server's bounds and resolves its settings before anything
  reaches the engine (:func:`rope_plugins.server.checks.check_rendered`), so that bad input is a
  400 before a stream starts.

Why mount rather than rewrite: these classes are what ``vllm serve`` runs, so every OpenAI field
vLLM honours is honoured here the same way, and the project writes none of it by hand. These are
internal APIs of the pinned vLLM (0.32); ``tests/server/test_server.py`` exercises the seam.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.exceptions import VLLMValidationError
from vllm.renderers.online_renderer import OnlineRenderer

from rope_plugins.server.checks import check_rendered, check_text_length
from rope_plugins.server.errors import API_PARAMS, bad_request, context_length_exceeded
from rope_plugins.server.extension import carry_settings

if TYPE_CHECKING:
    from rope_plugins.server.engine import EngineService

# vLLM's defaults for what `vllm serve` takes as flags, the ones this server does not expose
CHAT_TEMPLATE_CONTENT_FORMAT = "auto"
RESPONSE_ROLE = "assistant"


class ExtensionRenderer(OnlineRenderer):
    """vLLM's renderer (chat templates with tools, tokenizing), then this server's checks on
    each rendered prompt: its length and completion within the served context, the
    log-probability budget, and its ``context_extension`` settings, resolved for the positions
    it occupies (:func:`check_rendered`), then carried to the engine. A refusal raises ``APIError`` (400)."""

    def __init__(self, service: EngineService, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = service

    async def render_chat(self, request, **kwargs):
        check_text_length(messages_characters(request.messages), self.service.bounds, "messages")
        with refusals_named("messages", self.service.config.max_model_len):
            result = await super().render_chat(request, **kwargs)
        if not isinstance(result, ErrorResponse):
            await self.check_request(request, result[1], prompt_param="messages")
        return result

    async def render_completion(self, request, **kwargs):
        prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        for text in prompts:
            if isinstance(text, str):
                check_text_length(len(text), self.service.bounds, "prompt")
        with refusals_named("prompt", self.service.config.max_model_len):
            result = await super().render_completion(request, **kwargs)
        if not isinstance(result, ErrorResponse):
            await self.check_request(request, result, prompt_param="prompt")
        return result

    async def render_responses(self, request, **kwargs):
        check_text_length(len(str(request.input)) + len(request.instructions or ""), self.service.bounds, "input")
        with refusals_named("input", self.service.config.max_model_len):
            result = await super().render_responses(request, **kwargs)
        if not isinstance(result, ErrorResponse):
            await self.check_request(request, [result.engine_input], prompt_param="input")
        return result

    async def check_request(self, request: Any, engine_inputs: list[Any], prompt_param: str) -> None:
        """The rendered request within bounds, its sampling as the engine will check it, and each
        prompt's settings carried to the engine (and kept for the response)."""
        applied, max_tokens = check_rendered(request, engine_inputs, prompt_param, self.service.bounds,
                                             self.service.defaults)
        if engine_inputs:
            await self.service.verify_sampling(request, max_tokens)
        carry_settings(request, engine_inputs, applied)


@contextlib.contextmanager
def refusals_named(prompt_param: str, served: int) -> Iterator[None]:
    """vLLM's renderer raises its refusals (a prompt past the served context, token ids out of
    the vocabulary): as this server's 400, naming the request's field. vLLM names a prompt too
    long to serve ``input_tokens`` or ``input_text`` (vllm/renderers/params.py)."""
    try:
        yield
    except VLLMValidationError as error:
        if error.parameter == "input_tokens":  # vLLM counts up to the first token too many
            raise context_length_exceeded(
                f"{prompt_param}: the prompt has at least {error.value} tokens; this server's maximum context is "
                f"{served} tokens (prompt + completion)",
                prompt_param) from None
        if error.parameter == "input_text":  # so many characters that no tokenizing can fit them
            raise context_length_exceeded(f"{prompt_param}: {error}", prompt_param) from None
        param = API_PARAMS.get(error.parameter, error.parameter) if error.parameter else prompt_param
        raise bad_request(f"{param}: {error}", param=param) from None


def messages_characters(messages: list[Any]) -> int:
    """The characters of a conversation's text (its content and tool calls' arguments)."""
    return sum(len(str(message.get("content") or "")) + len(str(message.get("tool_calls") or ""))
               for message in messages if isinstance(message, dict))


@dataclass
class OpenAIServing:
    """vLLM's serving objects for one engine."""

    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    responses: OpenAIServingResponses
    tokenization: ServingTokenization


async def build_openai_serving(service: EngineService, tool_parser: str | None) -> OpenAIServing:
    """vLLM's serving classes around ``service``'s engine, configured as ``vllm serve`` would be
    with ``--enable-auto-tool-choice --tool-call-parser <tool_parser>`` (None: no parser, so
    ``tool_choice: "auto"`` is refused; "required" and a named function constrain decoding to
    the tools' schema on any model)."""
    engine = service.engine
    models = OpenAIServingModels(engine_client=engine, base_model_paths=[
        BaseModelPath(name=service.model_name, model_path=service.model_path)])
    # "parameter": a required or named tool call is held to its parameters' schema, as if each tool were
    # strict, so that it is a valid call on any model
    tools = dict(enable_auto_tools=tool_parser is not None, tool_parser=tool_parser, tool_strict_level="parameter")
    renderer = ExtensionRenderer(service, model_config=engine.model_config, renderer=engine.renderer,
                                 request_logger=None, chat_template=None,
                                 chat_template_content_format=CHAT_TEMPLATE_CONTENT_FORMAT, **tools)
    renderer.warmup()
    common = dict(request_logger=None, chat_template=None, chat_template_content_format=CHAT_TEMPLATE_CONTENT_FORMAT,
                  **tools)
    return OpenAIServing(
        chat=OpenAIServingChat(engine, models, RESPONSE_ROLE, online_renderer=renderer, **common),
        completion=OpenAIServingCompletion(engine, models, online_renderer=renderer, request_logger=None),
        responses=OpenAIServingResponses(engine, models, renderer, tool_server=None, **common),
        tokenization=ServingTokenization(models, renderer, request_logger=None, chat_template=None,
                                         chat_template_content_format=CHAT_TEMPLATE_CONTENT_FORMAT))
