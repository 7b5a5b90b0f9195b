"""Request and response bodies, as the OpenAI API (and vLLM's server) shape them.

Every field a request may carry is declared here, with its bounds: it is honoured (passed on to
vLLM's own request model and serving class, :mod:`server.vllm_handlers`) or, if it cannot
change the answer, accepted and ignored (:data:`IGNORED_FIELDS`). Any other field is refused
with a 400 naming it, as is a bad value. Nested OpenAI objects (``response_format``, ``tools``,
``tool_choice``, ``structured_outputs``) are bounded in size here and checked field by field by
vLLM's request models.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from rope_plugins.rules.settings import METHOD_NAMES, SELF_EXTEND_GROUPS, ExtensionSettings, MethodName

# Bounds on what a request may ask for. Integers that reach the engine stay inside its int32
# / int64 fields; lists and strings are bounded so that validation itself stays cheap.
MAX_INT32 = 2**31 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_NAME_CHARS = 256
MAX_TOOLS = 128  # tools one request may declare (OpenAI allows 128)
MAX_TOOL_CALLS = 128  # tool calls one assistant message may carry
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_TOKEN_LIST = 4096  # stop_token_ids, allowed_token_ids, bad_words
MAX_METADATA = 16  # OpenAI's limit on metadata entries

# Fields accepted and ignored: they cannot change the answer (docs/usage.md, "Requests").
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})


def valid_unicode(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``): no tokenizer, log or response
    can encode it, so it is refused here, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(valid_unicode)]
StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Metadata = Annotated[dict[Name, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)]
# an OpenAI object checked field by field by vLLM's request model (its size bounded by the body limit)
OpenAIObject = dict[str, Any]


_SETTINGS_SCHEMA = ExtensionSettings.model_json_schema()["properties"]


def settings_field_schema(name: str, **extra: Any) -> WithJsonSchema:
    """A settings field documented as ExtensionSettings accepts it: its bounds stated once, there
    (the default is the server's, so it is left out)."""
    schema = _SETTINGS_SCHEMA[name]
    schema = next((branch for branch in schema.get("anyOf", []) if branch.get("type") != "null"), schema)
    return WithJsonSchema({key: value for key, value in schema.items() if key not in ("default", "title")} | extra)


class ContextExtension(BaseModel):
    """Per-request RoPE extension (the ``context_extension`` body field; ``extra_body`` in the
    OpenAI clients). Unset fields take the server's defaults; checked fully by
    :func:`rope_plugins.server.extension.resolve_extension` once the prompt length is known."""

    # Each field is typed as a valid request has it, but only the object's shape is checked here
    # (an object, no unknown field): its values are checked once, where the training length and
    # the positions the prompt occupies are known, so that every bound is in one place
    # (ExtensionSettings: strict, so log_n must be a bool) and every refusal names its field the
    # same way. The schema documents what it accepts.
    model_config = ConfigDict(extra="forbid")

    method: Annotated[MethodName | Literal["auto"] | None, SkipValidation,
                      WithJsonSchema({"enum": ["auto", *METHOD_NAMES]})] = None
    factor: Annotated[float | Literal["auto"] | None, SkipValidation, WithJsonSchema(
        {"anyOf": [settings_field_schema("factor").json_schema, {"const": "auto"}],
         "description": "'auto': max(1, (prompt + max_tokens - 1) / train_length)"})] = None
    window: Annotated[int | None, SkipValidation, settings_field_schema(
        "window", description="smaller than train_length")] = None
    leaky_k: Annotated[float | None, SkipValidation, settings_field_schema("leaky_k")] = None
    beta: Annotated[float | None, SkipValidation, settings_field_schema("beta")] = None
    group: Annotated[int | None, SkipValidation, settings_field_schema(
        "group", description=f"Self-Extend's group size: one of {', '.join(map(str, SELF_EXTEND_GROUPS))}")] = None
    shift: Annotated[int | None, SkipValidation, settings_field_schema(
        "shift", description="STRING's shift S: relative positions from S on start again at local; smaller "
                             "than train_length")] = None
    local: Annotated[int | None, SkipValidation, settings_field_schema(
        "local", description="STRING's local value W: where the shifted positions start; smaller than shift")] = None
    chunk_size: Annotated[int | None, SkipValidation, settings_field_schema(
        "chunk_size", description="dual-chunk attention's chunk size C: the largest relative position; at most "
                                  "train_length, and C - local_window a multiple of 64 above local_window")] = None
    local_window: Annotated[int | None, SkipValidation, settings_field_schema(
        "local_window", description="dual-chunk attention's local window: chunks are chunk_size - local_window "
                                    "long")] = None
    log_n: Annotated[bool | None, SkipValidation, settings_field_schema("log_n")] = None
    train_length: Annotated[int | None, SkipValidation, settings_field_schema(
        "train_length", description="at most the longer of the served context and the checkpoint's training "
                                    "length")] = None

    def fields(self) -> dict[str, Any]:
        """The fields the request sets (read as given: a value of another type is the resolution's to refuse)."""
        return {name: getattr(self, name) for name in type(self).model_fields if getattr(self, name) is not None}


# Requests are validated strictly (1.0 is not an integer, 0 is not false), as the schema says.
REQUEST_CONFIG = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions (and the sampling fields vLLM adds)."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    model: Name
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: StopSequence | list[StopSequence] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the engine's int64
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(max_length=12)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    response_format: OpenAIObject | None = None
    # ignored: they cannot change the answer
    user: Name | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Name | None = None
    # vLLM's extensions (its sampling fields, structured outputs and prefix-cache salt)
    top_k: int = Field(0, ge=-1, le=MAX_INT32)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKEN_LIST)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_TOKEN_LIST)
    bad_words: list[StopSequence] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    structured_outputs: OpenAIObject | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)] | None = None
    context_extension: ContextExtension | None = None

    def constraint_field(self) -> str | None:
        """The field that constrains decoding, if one does: what a grammar refusal is about."""
        forced_tools = getattr(self, "tool_choice", None) not in (None, "none", "auto")
        return next((name for name, used in (("structured_outputs", self.structured_outputs is not None),
                                             ("response_format", self.response_format is not None),
                                             ("tools", forced_tools)) if used), None)

    def vllm_fields(self) -> dict[str, Any]:
        """The request as vLLM's own request model reads it: the fields the client set, less
        this server's own and the ignored ones."""
        return self.model_dump(exclude_unset=True, exclude={"context_extension", *IGNORED_FIELDS})


class TextPart(BaseModel):
    """A content part; this server's models read text only."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    name: Name
    arguments: Text  # JSON, as the model wrote it


class ToolCall(BaseModel):
    """A tool call an assistant message made (what the API answered, sent back)."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    id: Name
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A message of the conversation: its text, and an assistant's tool calls or a tool's answer."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant's
    tool_call_id: Name | None = None  # a tool message's: the call it answers
    # what the OpenAI clients send back with an assistant message they received: always empty here
    refusal: None = None
    annotations: list[Any] | None = Field(None, max_length=0)
    audio: None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A non-text part gets its own message (the union's errors would say 'not a string')."""
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"part {index} has type {str(kind)[:40]!r}; this model reads text parts only")
        return content

    def text(self) -> str:
        """Text content; the text parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it: its role and its text."""
        return {"role": self.role, "content": self.text()}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[OpenAIObject] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | OpenAIObject | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def unanswerable_tool_message(self) -> tuple[str, str] | None:
        """A tool message must answer a call an earlier assistant message made, by its id; the
        first that does not, as (param, reason)."""
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            if message.tool_calls and message.role != "assistant":
                return f"messages.{index}.tool_calls", "only an assistant message makes tool calls"
            called.update(call.id for call in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id is None:
                return f"messages.{index}.tool_call_id", "a tool message names the call it answers"
            if message.role == "tool" and message.tool_call_id not in called:
                return (f"messages.{index}.tool_call_id",
                        f"{message.tool_call_id[:80]!r} answers no tool call of an earlier assistant message")
        return None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)  # the OpenAI default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None  # refused by vLLM unless the model renders fill-in-the-middle

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """One clear message for a malformed prompt (the union's would list every branch)."""
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("must be a string, a non-empty list of strings, a list of token ids, "
                             "or a list of lists of token ids")
        if all(isinstance(item, list) for item in prompt) and not all(prompt):
            raise ValueError("a token-id prompt is empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


def function_tool(kind: str) -> str:
    if kind != "function":
        raise ValueError(f"{kind!r} is a built-in tool, which this server does not run (no web search, file search, "
                         "code interpreter or MCP server here): declare it as a function tool "
                         "({\"type\": \"function\", \"name\": ..., \"parameters\": ...}) and run it yourself")
    return kind


class ResponsesTool(BaseModel):
    """A tool the Responses API may call: a function, whose fields vLLM's model checks."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="allow")

    type: Annotated[str, AfterValidator(function_tool)]


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: what ``client.responses.create`` sends for text and function
    tools. Stored responses are not kept here, so ``previous_response_id`` and ``background``
    are refused; ``store`` is ignored."""

    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    model: Name
    input: Text | list[OpenAIObject] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    tools: list[ResponsesTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | OpenAIObject | None = None
    parallel_tool_calls: bool | None = None
    text: OpenAIObject | None = None  # its format: text, json_object or json_schema
    truncation: Literal["disabled"] | None = None
    user: Name | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Name | None = None
    context_extension: ContextExtension | None = None

    def constraint_field(self) -> str | None:
        forced_tools = self.tool_choice not in (None, "none", "auto")
        return "text" if self.text is not None else "tools" if forced_tools else None

    def vllm_fields(self) -> dict[str, Any]:
        # store: vLLM would keep the response for previous_response_id, which this server refuses
        return {**self.model_dump(exclude_unset=True, exclude={"context_extension", *IGNORED_FIELDS}), "store": False}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    model: Name | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(**REQUEST_CONFIG, extra="forbid")

    model: Name | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


# ---- responses -------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


# The answer's role: the assistant's, or with add_generation_prompt false the last message's (it continues it)
AnswerRole = Literal["assistant", "system", "developer", "user", "tool"]


class AssistantMessage(BaseModel):
    role: AnswerRole = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # with finish_reason "tool_calls" (or "stop" for a named function)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    context_extension: dict[str, Any]  # the settings applied (also the x-context-extension header)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    context_extension: dict[str, Any] | None = None


class RotaryCard(BaseModel):
    """The checkpoint's own rotary on its full-attention layers, which the methods extend."""

    kind: str  # default, linear, llama3 or yarn
    base: float  # rope_theta
    head_dim: int
    attention_factor: float  # what the checkpoint's rotary puts on q and k (a declared YaRN's)


class KVCacheCard(BaseModel):
    """What the engine's KV cache holds (--kv-cache-dtype, --kv-cache-memory)."""

    dtype: str  # auto (the model's dtype), fp8, fp8_e4m3 or fp8_e5m2
    tokens: int  # the tokens it holds, over every running sequence
    bytes_per_token: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rope-extend"
    root: str
    max_model_len: int  # the served maximum: prompt + completion tokens
    train_length: int  # the checkpoint's training context ('auto' stays plain RoPE within it)
    rotary: RotaryCard
    kv_cache: KVCacheCard
    default_context_extension: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthStatus(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
