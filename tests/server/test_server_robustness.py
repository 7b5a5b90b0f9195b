"""Hostile input against the real server (real engine, real default model, real HTTP on
loopback), in one server started under ``make run``'s supervisor: a table of hand-made bad
requests, a schemathesis fuzz from the server's own OpenAPI schema, a client that hangs up, slow
clients, and last an engine killed under load.

Every bad request must get its 4xx with the OpenAI error body naming the field, write one log
line and no traceback, leave the client's keep-alive connection usable (a good request follows
on the same socket), and leave the engine serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from rope_plugins.testing.launcher import wait_healthy
from tests.server.fuzz import schema as fuzz
from tests.server.test_server import API_KEY, MODEL, assert_error_body, metric_value, start_server

ROOT = Path(__file__).resolve().parents[2]
SERVED = 512  # --max-model-len: a small context keeps every fuzzed generation short
STEP_TOKENS = 48  # --max-num-batched-tokens: a prompt of LONG_TEXT is prefilled in chunks
# 96 tokens of text, two steps and short enough to leave the rows' max_tokens in the served
# context: the hostile table's "hi" replaced by it
LONG_TEXT = "The mill by the river grinds grain for three villages, and the river floods each spring. " * 5
CAPACITY = 8  # --max-num-seqs 4 + --max-waiting 4
MAX_BODY = 1 << 20
READ_TIMEOUT = 2.0  # --read-timeout: the slow clients' deadline
MAX_LOGPROB_ENTRIES = 5000
LONGEST_TOKEN_CHARS = 81  # SmolLM2's longest vocabulary entry
CHAT, COMPLETIONS, RESPONSES, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_the_schema_documents_what_the_routes_answer():
    from rope_plugins.server.app import create_app
    from rope_plugins.server.config import ServerConfig

    document = create_app(ServerConfig(), model="/models/SmolLM2-135M-Instruct").openapi()
    for route in (CHAT, COMPLETIONS):
        answers = document["paths"][route]["post"]["responses"]
        assert {"application/json", "text/event-stream"} <= set(answers["200"]["content"])
        assert {"400", "401", "413", "429", "503"} <= set(answers)
    assert {"400", "429"} <= set(document["paths"][TOKENIZE]["post"]["responses"])
    assert "503" in document["paths"]["/health"]["get"]["responses"]
    assert all("422" not in operation["responses"] for path in document["paths"].values()
               for operation in path.values())
    model = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
    assert model["examples"] == ["SmolLM2-135M-Instruct"]


def test_a_failed_engine_zeroes_its_gauges_and_stops_serving_once_nothing_is_in_flight():
    """The watcher alone, on an app whose engine never started (no engine needed)."""
    import asyncio

    from rope_plugins.server.app import create_app, stop_when_the_engine_fails
    from rope_plugins.server.config import ServerConfig

    app = create_app(ServerConfig(), model="unused")
    service, capacity, stopped = app.state.service, app.state.capacity, []
    app.state.stop_serving = lambda: stopped.append(capacity.in_flight)
    service.metrics.running.set(2)
    capacity.in_flight = 1
    service.state, service.failure = "failed", "engine died: test"

    async def scenario():
        watcher = asyncio.create_task(stop_when_the_engine_fails(app, poll=0.01))
        await asyncio.sleep(0.2)
        assert not stopped, "stopped while a request was still failing"
        capacity.in_flight = 0
        await asyncio.wait_for(watcher, 2)

    asyncio.run(scenario())
    assert stopped == [0] and service.metrics.running._value.get() == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Under ``make run``'s supervisor, as deployments run it: this module's last test kills its
    engine and watches it come back."""
    server = start_server(tmp_path_factory.mktemp("robust") / "server.log", "--max-model-len", str(SERVED),
                          "--max-num-seqs", "4", "--max-waiting", "4", "--max-request-bytes", str(MAX_BODY),
                          "--max-logprob-entries", str(MAX_LOGPROB_ENTRIES), "--max-num-batched-tokens",
                          str(STEP_TOKENS), "--read-timeout", str(READ_TIMEOUT), supervised=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    """One keep-alive connection for the whole table."""
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=120) as client:
        yield client


def chat_body(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion_body(**fields):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def user(content):
    return [{"role": "user", "content": content}]


def responses_body(**fields):
    return {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}


def tool_spec(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def called(call_id, arguments="{}"):
    return {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function",
                                                 "function": {"name": "f", "arguments": arguments}}]}


def tool_answer(call_id):
    return {"role": "tool", "tool_call_id": call_id, "content": "x"}


INF, NAN = math.inf, math.nan
# (case, route, body: JSON-able, or bytes sent as they are; status; param)
BAD_REQUESTS = [
    ("settings that killed the engine", CHAT,
     chat_body(context_extension={"method": "rerope", "train_length": 2**64 - 1, "window": 2**63}),
     400, "context_extension.train_length"),
    ("window past int64", CHAT, chat_body(context_extension={"method": "rerope", "window": 2**63}),
     400, "context_extension.window"),
    ("train_length past what is served", CHAT, chat_body(context_extension={"method": "yarn", "train_length": 100_000}),
     400, "context_extension.train_length"),
    ("leaky_k Infinity", CHAT, chat_body(context_extension={"method": "leaky_rerope", "leaky_k": INF}),
     400, "context_extension.leaky_k"),
    ("leaky_k Infinity, streamed", CHAT,
     chat_body(stream=True, context_extension={"method": "leaky_rerope", "leaky_k": INF}), 400,
     "context_extension.leaky_k"),
    ("factor NaN", COMPLETIONS, completion_body(context_extension={"method": "ntk_mixed", "factor": NAN}),
     400, "context_extension.factor"),
    ("window as a string", COMPLETIONS, completion_body(context_extension={"method": "rerope", "window": "64"}),
     400, "context_extension.window"),
    ("settings not an object", COMPLETIONS, completion_body(context_extension="rerope"), 400, "context_extension"),
    ("a 100k-character method", COMPLETIONS, completion_body(context_extension={"method": "x" * 100_000}),
     400, "context_extension.method"),
    ("unknown settings field", COMPLETIONS, completion_body(context_extension={"colour": 1}),
     400, "context_extension.colour"),
    ("empty stop string", CHAT, chat_body(stop=[""]), 400, "stop.0"),
    ("17 stop strings", COMPLETIONS, completion_body(stop=["a"] * 17), 400, "stop"),
    ("2000-character stop", COMPLETIONS, completion_body(stop="x" * 2000), 400, "stop"),
    ("n 2 with greedy sampling", CHAT, chat_body(n=2, temperature=0), 400, "n"),
    ("min_tokens over max_tokens", COMPLETIONS, completion_body(min_tokens=10), 400, "min_tokens"),
    ("min_tokens over the default max_tokens", CHAT, chat_body(max_tokens=None, min_tokens=SERVED), 400, "min_tokens"),
    ("empty prompt list", COMPLETIONS, completion_body(prompt=[]), 400, "prompt"),
    ("empty token-id prompt", COMPLETIONS, completion_body(prompt=[[]]), 400, "prompt"),
    ("negative token id", COMPLETIONS, completion_body(prompt=[1, -1]), 400, "prompt.1"),
    ("token id past the vocabulary", COMPLETIONS, completion_body(prompt=[1, 10**6]), 400, "prompt"),
    ("token id past int64", COMPLETIONS, completion_body(prompt=[2**70]), 400, "prompt.0"),
    ("false as a token id", COMPLETIONS, completion_body(prompt=[[False]]), 400, "prompt"),
    ("lone surrogate in chat content", CHAT, chat_body(messages=user("A\ud800B")), 400, "messages.0.content"),
    ("lone surrogate in a prompt", COMPLETIONS, completion_body(prompt="A\ud800B"), 400, "prompt"),
    ("lone surrogate in the model", COMPLETIONS, completion_body(model="\udfff"), 400, "model"),
    ("lone surrogate in a stop", COMPLETIONS, completion_body(stop=["\ud800"]), 400, "stop.0"),
    ("image part", CHAT, chat_body(messages=user([{"type": "image_url", "image_url": {"url": "x"}}])),
     400, "messages.0.content"),
    ("text part without text", CHAT, chat_body(messages=user([{"type": "text"}])), 400, "messages.0.content.0.text"),
    ("/tokenize with an audio part", TOKENIZE, {"messages": user([{"type": "input_audio"}])}, 400,
     "messages.0.content"),
    ("/tokenize with a lone surrogate", TOKENIZE, {"prompt": "\udfff"}, 400, "prompt"),
    ("/tokenize with prompt and messages", TOKENIZE, {"prompt": "a", "messages": user("a")}, 400, None),
    ("/tokenize with a body over the limit", TOKENIZE, {"prompt": "a" * MAX_BODY}, 413, None),
    ("seed past int64", COMPLETIONS, completion_body(seed=2**63), 400, "seed"),
    ("seed below int64", COMPLETIONS, completion_body(seed=-(2**63) - 1), 400, "seed"),
    ("temperature NaN", COMPLETIONS, completion_body(temperature=NAN), 400, "temperature"),
    ("top_p -Infinity", COMPLETIONS, completion_body(top_p=-INF), 400, "top_p"),
    ("max_tokens past int32", COMPLETIONS, completion_body(max_tokens=2**40), 400, "max_tokens"),
    ("n as a float", COMPLETIONS, completion_body(n=2.0), 400, "n"),
    ("stream as 0", COMPLETIONS, completion_body(stream=0), 400, "stream"),
    ("n past the whole capacity", COMPLETIONS, completion_body(n=CAPACITY + 1, temperature=1.0), 400, "n"),
    ("prompts x n past the whole capacity", COMPLETIONS, completion_body(prompt=["a"] * 3, n=3, temperature=1.0),
     400, "n"),
    ("more prompts than the whole capacity", COMPLETIONS, completion_body(prompt=["a"] * (CAPACITY + 1)), 400,
     "prompt"),
    ("logprobs 21", COMPLETIONS, completion_body(logprobs=21), 400, "logprobs"),
    ("max_tokens x logprobs past the limit", COMPLETIONS, completion_body(max_tokens=400, logprobs=20), 400,
     "logprobs"),
    ("max_tokens x top_logprobs past the limit", CHAT, chat_body(max_tokens=300, logprobs=True, top_logprobs=20),
     400, "top_logprobs"),
    ("text too long to tokenize", COMPLETIONS, completion_body(prompt="a" * (SERVED * LONGEST_TOKEN_CHARS + 1)),
     400, "prompt"),
    ("chat text too long to tokenize", CHAT, chat_body(messages=user("a" * (SERVED * LONGEST_TOKEN_CHARS + 1))),
     400, "messages"),
    ("many short messages whose template is too long to tokenize", CHAT,
     chat_body(messages=user("a") * (SERVED * LONGEST_TOKEN_CHARS // 20)), 400, "messages"),
    ("prompt longer than the served context", COMPLETIONS, completion_body(prompt="hello " * (SERVED + 10)),
     400, "prompt"),
    ("max_tokens past the served context", COMPLETIONS, completion_body(max_tokens=SERVED), 400, "max_tokens"),
    ("unknown model", COMPLETIONS, completion_body(model="gpt-9"), 400, "model"),
    ("300-character model", COMPLETIONS, completion_body(model="m" * 300), 400, "model"),
    ("unknown role", CHAT, chat_body(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    ("no messages", CHAT, chat_body(messages=[]), 400, "messages"),
    ("include_usage as a string", CHAT, chat_body(stream_options={"include_usage": "yes"}),
     400, "stream_options.include_usage"),
    # structured outputs and tools (vLLM's grammar compiler refuses some: still a 400 naming the field)
    ("a JSON schema the compiler refuses", CHAT, chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), 400, "response_format"),
    ("a JSON schema the compiler refuses, streamed", CHAT, chat_body(stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), 400, "response_format"),
    ("a response_format of no known type", CHAT, chat_body(response_format={"type": "xml"}), 400,
     "response_format.format"),
    ("a regex that does not parse", COMPLETIONS, completion_body(structured_outputs={"regex": "(unclosed"}),
     400, "structured_outputs"),
    ("a grammar that does not parse, streamed", COMPLETIONS,
     completion_body(stream=True, structured_outputs={"grammar": "root ::= ("}), 400, "structured_outputs"),
    ("two constraints at once", CHAT, chat_body(structured_outputs={"regex": "a", "choice": ["b"]}),
     400, "structured_outputs"),
    ("an empty choice", CHAT, chat_body(structured_outputs={"choice": []}), 400, "structured_outputs"),
    ("a tool whose schema the compiler refuses", CHAT, chat_body(
        tools=[tool_spec(parameters={"type": "objekt"})], tool_choice="required"), 400, "tools"),
    ("a tool that is not an object", CHAT, chat_body(tools=["f"]), 400, "tools.0"),
    ("a tool without a name", CHAT, chat_body(tools=[{"type": "function", "function": {}}]), 400,
     "tools.0.function.name"),
    ("129 tools", CHAT, chat_body(tools=[tool_spec(f"f{i}") for i in range(129)]), 400, "tools"),
    ("a named tool not among the tools", CHAT, chat_body(
        tools=[tool_spec()], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool_choice without tools", CHAT, chat_body(tool_choice="required"), 400, "tool_choice"),
    ("a tool answer to no call", CHAT, chat_body(messages=[*user("hi"), called("a"), tool_answer("b")]),
     400, "messages.2.tool_call_id"),
    ("a tool answer naming no call", CHAT, chat_body(messages=[{"role": "tool", "content": "x"}]),
     400, "messages.0.tool_call_id"),
    ("tool call arguments not a string", CHAT, chat_body(messages=[*user("hi"), called("a", arguments={}),
                                                                   tool_answer("a")]),
     400, "messages.1.tool_calls.0.function.arguments"),
    ("a user message with tool calls", CHAT, chat_body(messages=[{**called("a"), "role": "user", "content": "hi"}]),
     400, "messages.0.tool_calls"),
    ("logit_bias with a key not a token id", CHAT, chat_body(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias past the vocabulary", CHAT, chat_body(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("logit_bias 101", CHAT, chat_body(logit_bias={"1": 101}), 400, "logit_bias"),
    ("allowed_token_ids past the vocabulary", COMPLETIONS, completion_body(allowed_token_ids=[999999]), 400,
     "allowed_token_ids"),
    ("stop_token_ids past the vocabulary", CHAT, chat_body(stop_token_ids=[999999]), 400, "stop_token_ids"),
    ("top_k -2", CHAT, chat_body(top_k=-2), 400, "top_k"),
    ("prompt_logprobs 21", COMPLETIONS, completion_body(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("an OpenAI field not served (audio)", CHAT, chat_body(audio={"voice": "x"}), 400, "audio"),
    ("vLLM's vllm_xargs (context_extension is this server's)", CHAT,
     chat_body(vllm_xargs={"context_extension.method": "rerope"}), 400, "vllm_xargs"),
    ("a chat template in the request", CHAT, chat_body(chat_template="{{ 1 }}"), 400, "chat_template"),
    ("/v1/responses after a stored response", RESPONSES, responses_body(previous_response_id="resp_1"), 400,
     "previous_response_id"),
    ("/v1/responses with a bad extension", RESPONSES, responses_body(context_extension={"method": "warp"}), 400,
     "context_extension.method"),
    ("/v1/responses with a built-in tool", RESPONSES, responses_body(tools=[{"type": "web_search_preview"}]), 400,
     "tools.0.type"),
    # grammars the engine gave up on after admission (a 500 before): tried in front, named
    ("a 50,000-way regex that compiles past the bound", CHAT,
     chat_body(structured_outputs={"regex": "|".join(f"opt{i}x" for i in range(50_000))}), 400, "structured_outputs"),
    ("a left-recursive grammar that allows no token", CHAT,
     chat_body(structured_outputs={"grammar": 'root ::= root "a"'}), 400, "structured_outputs"),
    ("a left-recursive grammar, streamed", COMPLETIONS,
     completion_body(stream=True, structured_outputs={"grammar": 'root ::= root "a"'}), 400, "structured_outputs"),
    ("/v1/responses with an empty input", RESPONSES, responses_body(input=[]), 400, "input"),
    ("/detokenize past int32", "/detokenize", {"tokens": [2**40]}, 400, "tokens.0"),
    ("body is a list", COMPLETIONS, [1, 2], 400, None),
    ("body is not JSON", COMPLETIONS, b"{not json", 400, None),
    ("body is not UTF-8", COMPLETIONS, b'{"model": "\xff\xfe"}', 400, None),
    ("body over the limit", COMPLETIONS, completion_body(prompt="a" * MAX_BODY), 413, None),
]


def send(http: httpx.Client, route: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes NaN, Infinity, \ud800
    return http.post(route, content=content, headers={"content-type": "application/json"})


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def lengthened(body):
    """``body`` with its short prompt ("hi", in any of the three routes' shapes) made LONG_TEXT."""
    if not isinstance(body, dict):
        return body
    if body.get("prompt") == "hi" or body.get("input") == "hi":
        return {**body, **{key: LONG_TEXT for key in ("prompt", "input") if body.get(key) == "hi"}}
    if body.get("messages") == user("hi"):
        return {**body, "messages": user(LONG_TEXT)}
    return body


@pytest.mark.parametrize("length", ["short", "long"])
@pytest.mark.parametrize("case, route, body, status, param", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_is_refused_naming_the_field_and_the_connection_and_engine_carry_on(
        server, http, case, route, body, status, param, length):
    """Each hostile request, with its short prompt and with one prefilled in chunks."""
    log_before = server.log.read_text()
    response = send(http, route, lengthened(body) if length == "long" else body)
    error = assert_error_body(response, status, param)
    assert len(error["message"]) <= 1100, "an error message must not echo a huge input"
    if status == 400 and param:
        assert param.split(".")[0] in error["message"]
    # the same keep-alive connection serves a good request next, through the engine
    good = http.post(COMPLETIONS, json=completion_body(prompt="Once upon a time", max_tokens=2))
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    assert local_port(good) == local_port(response), "the server dropped the keep-alive connection"
    # one log line for the failure (plus the good request's line), and no traceback
    new_lines = server.log.read_text()[len(log_before):].splitlines()
    failures = [line for line in new_lines if f"-> {status}" in line]
    assert len(failures) == 1 and "Traceback" not in "\n".join(new_lines), new_lines
    assert all(len(line) < 1000 for line in new_lines)


# Grammars that are costly to compile or to follow; each must be answered (served or refused) in
# bounded time, with the engine serving the next request. Seen here: at most 1.2 s each.
COSTLY_GRAMMARS = {
    "nested repetition": {"regex": "(a{1000}){1000}"},
    "a DFA that blows up": {"regex": "(a|b)*a(a|b){25}"},
    "catastrophic backtracking": {"regex": "(a+)+(b+)+(c+)+(d+)+$" * 20},
    "5000 required properties": {"json": {"type": "object",
                                          "properties": {f"p{i}": {"type": "string"} for i in range(5000)},
                                          "required": [f"p{i}" for i in range(5000)]}},
    "a million-character string": {"json": {"type": "string", "minLength": 10**6, "maxLength": 10**6}},
    "100,000 items": {"json": {"type": "array", "items": {"type": "string"}, "minItems": 100_000}},
    "500 nested groups": {"grammar": "root ::= " + "(" * 500 + '"a"' + ")" * 500},
    "10,000 choices": {"choice": [f"option{i}" for i in range(10_000)]},
}
COSTLY_GRAMMAR_SECONDS = 30


@pytest.mark.parametrize("name", sorted(COSTLY_GRAMMARS))
def test_a_costly_grammar_is_answered_in_bounded_time(http, name):
    began = time.monotonic()
    response = http.post(COMPLETIONS, json=completion_body(structured_outputs=COSTLY_GRAMMARS[name]))
    assert response.status_code in (200, 400), response.text
    assert time.monotonic() - began < COSTLY_GRAMMAR_SECONDS
    assert http.post(COMPLETIONS, json=completion_body(max_tokens=2)).status_code == 200


def test_tokenize_counts_a_text_longer_than_the_served_context(http):
    """Counting a long text's tokens (to cut a corpus, say) is what /tokenize is for."""
    text = "hello " * (SERVED * LONGEST_TOKEN_CHARS // 6 + 100)
    response = http.post(TOKENIZE, json={"prompt": text})
    assert response.status_code == 200 and response.json()["count"] > SERVED


def test_body_over_the_limit_without_a_length_is_a_413(server, http):
    def chunks():
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"a" * 65536

    response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error_body(response, 413)
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_the_fuzzer_finds_no_5xx_and_the_schema_matches_the_answers(server, tmp_path):
    """schemathesis from /openapi.json (tests/server/fuzz/schema.py, with a small budget): seeded; every
    answer a documented status, content type and body (OpenAI errors included), bad data
    refused, no 5xx."""
    result = fuzz.schemathesis_run(server.base, API_KEY, examples=40, seed=16, report_dir=tmp_path, timeout=900)
    summary = result.stdout[-4000:]
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert fuzz.generated_count(summary) >= 200, summary
    assert httpx.get(f"{server.base}/health").status_code == 200
    log = server.log.read_text()
    assert "Traceback" not in log and not any(key.startswith("5") for key in fuzz.answers_by_status(log))


def test_a_client_that_hangs_up_a_plain_request_is_aborted_quietly(server):
    aborted = metric_value(server, "rope_extend_requests_total", outcome="aborted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}{COMPLETIONS}", headers=AUTH, timeout=2,
                   json=completion_body(prompt="Count to a thousand:", max_tokens=400, ignore_eos=True))
    deadline = time.time() + 30
    while metric_value(server, "rope_extend_requests_total", outcome="aborted") <= aborted and time.time() < deadline:
        time.sleep(0.5)
    assert metric_value(server, "rope_extend_requests_total", outcome="aborted") == aborted + 1
    log = server.log.read_text()
    assert "the client disconnected" in log and "Traceback" not in log


# ---- slow clients (server/slow_clients.py; this module's server reads with --read-timeout) ---
#
# In one wave: 300 connections that send their headers a byte at a time are each answered 408
# and closed between 2 s and 2 s + slack after they opened; a body that stalls half-way has its
# connection closed; meanwhile /health (polled, answered within half a second as a rule), a
# completion, a body sent in two parts within the deadline and a keep-alive connection left idle
# past the deadline are all answered.

SLACK = 3.0  # a loaded two-core machine: the event loop, 300 timers, the engine's processes
TRICKLERS = 300
TRICKLE_EVERY = 0.5  # seconds between bytes: their headers would take 30 s
SLOW_HEADERS = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: one-byte-at-a-time\r\n\r\n"
SLOW_COMPLETION = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}).encode()
POST_HEAD = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {API_KEY}\r\n"
             f"content-type: application/json\r\ncontent-length: {len(SLOW_COMPLETION)}\r\n\r\n").encode()


async def trickle(port: int) -> tuple[float, bytes]:
    """Send SLOW_HEADERS a byte at a time until the server closes: the seconds from asking to
    connect to the close, and what the server sent. The server's deadline runs from its accept,
    which comes after the ask; with 300 connections opening at once on a loaded machine, this
    loop can see its connection a second after the server did, so the clock starts before it."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.create_task(reader.read())  # up to the server's close
    for byte in SLOW_HEADERS:
        writer.write(bytes([byte]))
        await asyncio.wait([answer], timeout=TRICKLE_EVERY)
        if answer.done():
            break
    try:
        received = await asyncio.wait_for(answer, 10)  # the headers complete: the server's answer
    except ConnectionResetError:  # a byte arrived after the server closed
        received = b""
    closed = time.monotonic() - start
    writer.close()
    return closed, received


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
    return int(head.split()[1]), await reader.readexactly(int(fields[b"content-length"]))


async def stalled_body(port: int) -> tuple[float, bytes]:
    """Headers, half the body, then nothing: the seconds until the server closes, and what it sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(POST_HEAD + SLOW_COMPLETION[: len(SLOW_COMPLETION) // 2])
    received = await asyncio.wait_for(reader.read(), READ_TIMEOUT + SLACK + 10)
    writer.close()
    return time.monotonic() - start, received


async def body_in_two_parts(port: int) -> int:
    """Half the body, a pause shorter than the deadline, the rest: answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(POST_HEAD + SLOW_COMPLETION[: len(SLOW_COMPLETION) // 2])
    await asyncio.sleep(READ_TIMEOUT / 2)
    writer.write(SLOW_COMPLETION[len(SLOW_COMPLETION) // 2:])
    status, _ = await read_response(reader)
    writer.close()
    return status


async def idle_keep_alive(port: int) -> list[int]:
    """Two requests on one connection, idle between them past the read deadline but within
    uvicorn's keep-alive (5 s): the deadline runs from a request's first byte, not while idle."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    statuses = []
    for pause in (0, READ_TIMEOUT + 1):
        await asyncio.sleep(pause)
        writer.write(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        statuses.append((await read_response(reader))[0])
    writer.close()
    return statuses


async def wave(base: str, port: int) -> dict:
    tricklers = [asyncio.create_task(trickle(port)) for _ in range(TRICKLERS)]
    others = asyncio.gather(stalled_body(port), body_in_two_parts(port), idle_keep_alive(port))
    health: list[tuple[int, float, float]] = []  # status, when asked (s into the wave), seconds to answer
    wave_start = time.monotonic()
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        completion = asyncio.create_task(http.post("/v1/completions", content=SLOW_COMPLETION,
                                                   headers={"content-type": "application/json"}))
        while not all(task.done() for task in tricklers):  # /health every 0.2 s until the last is closed
            start = time.monotonic()
            health.append(((await http.get("/health")).status_code, start - wave_start, time.monotonic() - start))
            await asyncio.sleep(0.2)
        completion = await completion
    stalled, two_parts, keep_alive = await others
    return {"tricklers": [task.result() for task in tricklers], "health": health, "completion": completion,
            "stalled": stalled, "two_parts": two_parts, "keep_alive": keep_alive}


def test_slow_clients_are_cut_at_the_read_deadline_while_the_server_keeps_answering(server):
    port = int(server.base.rsplit(":", 1)[1])
    started = time.monotonic()
    result = asyncio.run(wave(server.base, port))
    wall = time.monotonic() - started

    closed = sorted(seconds for seconds, _ in result["tricklers"])
    slowest_health = max(seconds for _, _, seconds in result["health"])
    print(f"\n{TRICKLERS} slow connections closed {closed[0]:.2f} .. {closed[-1]:.2f} s after opening; wave "
          f"{wall:.1f} s; /health polled {len(result['health'])} times, slowest {slowest_health:.2f} s; "
          f"stalled body closed after {result['stalled'][0]:.2f} s")
    assert READ_TIMEOUT - 0.2 <= closed[0] and closed[-1] <= READ_TIMEOUT + SLACK
    answers = [received for _, received in result["tricklers"]]
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), {answer[:40] for answer in answers}
    assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"

    print("/health polls (asked at s: took s):", ", ".join(f"{at:.2f}: {took:.2f}" for _, at, took in result["health"]))
    assert {status for status, _, _ in result["health"]} == {200} and len(result["health"]) >= 5
    # answered promptly as a rule; a single poll may wait out a stall of the loaded machine (CI saw one of
    # 2.3 s that no rerun here showed, polls asked in the storm of 300 timeouts take 0.06-0.08 s here)
    assert statistics.median(seconds for _, _, seconds in result["health"]) < 0.5
    assert slowest_health < SLACK
    assert result["completion"].status_code == 200, result["completion"].text
    assert result["completion"].json()["choices"][0]["text"]
    assert result["two_parts"] == 200
    assert result["keep_alive"] == [200, 200]

    seconds, received = result["stalled"]
    assert READ_TIMEOUT - 0.2 <= seconds <= READ_TIMEOUT + SLACK and received == b""

    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    assert "Traceback" not in server.log.read_text()


# ---- a dead engine ---------------------------------------------------------------------------


def test_a_killed_engine_fails_what_is_in_flight_then_make_runs_supervisor_serves_again(server):
    """Under ``make run``'s supervisor (server/supervisor.py): the requests in flight fail in the
    OpenAI shape, the server exits with status 3, the supervisor says why in one line and starts
    it again on the same port, and /health answers 200 there. (The module's last test: what its
    log says from here on is this test's.)"""
    import psutil

    earlier = len(server.log.read_text())

    def log_since() -> str:
        return server.log.read_text()[earlier:]

    try:
        long = completion_body(prompt="Count to a thousand:", max_tokens=SERVED - 16, ignore_eos=True)
        answers: dict[str, object] = {}

        def plain():
            answers["plain"] = httpx.post(f"{server.base}{COMPLETIONS}", json=long, headers=AUTH, timeout=120)

        def streamed():
            with httpx.stream("POST", f"{server.base}{COMPLETIONS}", json={**long, "stream": True}, headers=AUTH,
                              timeout=120) as response:
                answers["stream_status"] = response.status_code
                answers["events"] = [line for line in response.iter_lines() if line.startswith("data:")]

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        time.sleep(3)  # both decoding
        engines = [p for p in psutil.Process(server.process.pid).children(recursive=True)
                   if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
        assert engines, "no engine-core process found"
        for engine in engines:
            engine.kill()
        for thread in threads:
            thread.join(120)
        # the plain request: 503 in the OpenAI shape (it was a 500)
        assert_error_body(answers["plain"], 503)
        # the stream: its 200 went out; it ends with an error event, then [DONE]
        events = answers["events"]
        assert answers["stream_status"] == 200 and events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_unavailable"
        # then the server exits with its documented status, and the supervisor starts it again
        deadline = time.time() + 90
        while "starting it again" not in log_since() and time.time() < deadline:
            time.sleep(0.5)
        log = log_since()
        assert "exiting with status 3" in log and log.count("-> 503") + log.count("error=503") >= 2
        [restart] = [line for line in log.splitlines() if "starting it again" in line]
        assert "exited with status 3" in restart and "the engine failed: engine died" in restart, restart
        wait_healthy(server, 600)
        again = httpx.post(f"{server.base}{COMPLETIONS}", json=completion_body(max_tokens=2), headers=AUTH, timeout=120)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
        server.stop()  # SIGTERM to the supervisor: passed on; it exits once the server stopped, as the server did
        assert server.process.returncode in (0, 128 + signal.SIGTERM)
        after = log_since().split(restart, 1)[1]
        assert "Traceback" not in after and "starting it again" not in after
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in psutil.Process(server.process.pid).children(recursive=True):
                process.kill()
        if server.process.poll() is None:
            server.process.kill()
