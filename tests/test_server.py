"""The HTTP server, over real HTTP on loopback, against the real engine and the real default
model (SmolLM2-135M-Instruct), with the official ``openai`` client.

One server process serves the whole module (small limits so that the queue can be filled:
2 running + 1 waiting). Every error case checks the status, the OpenAI error body, and that
a good request running at the same time completes normally. The last test stops the server
with SIGTERM while a request runs. Hostile input and a killed engine: test_server_robustness.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version as package_version
from pathlib import Path

import httpx
import openai
import pytest

from launcher import ServerProcess
from launcher import start_server as launch

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent


def start_server(log: Path, *flags: str) -> ServerProcess:
    """A server on the real default model with the test limits, the API key from the environment
    (as deployments pass it)."""
    base_flags = ["--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory", str(256 << 20)]
    try:
        return launch([*base_flags, *flags], log, env={"ROPE_EXTEND_API_KEY": API_KEY}, timeout=600)
    except RuntimeError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("server") / "server.log", "--max-num-seqs", "2",
                          "--max-waiting", "1", "--shutdown-timeout", "60")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def chat(client, text="What is the capital of France?", **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=extra.pop("max_tokens", 24), **extra)


class Concurrently:
    """A good streaming request running while the test does something bad next to it."""

    def __init__(self, client, tokens=48):
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
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                            temperature=0, max_tokens=24, stream=True,
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
        model=MODEL, prompt="Hello", max_tokens=2, extra_body={"context_extension": {"method": "yarn", "factor": "auto"}})
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
])
def test_bad_extension_field_is_a_400_naming_it(server, client, extension, param):
    with Concurrently(client):
        response = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                        "context_extension": extension})
        error = assert_error_body(response, 400, param)
        assert param.split(".")[-1] in error["message"]


def test_bad_sampling_field_is_a_400_naming_it(server, client):
    with Concurrently(client):
        response = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1})
        assert_error_body(response, 400, "temperature")
        response = httpx.post(f"{server.base}/v1/completions", content=b"{not json",
                              headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
        assert_error_body(response, 400)


def test_prompt_longer_than_the_served_maximum_is_a_400_with_both_numbers(server, client):
    with Concurrently(client):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="hello " * 5000, max_tokens=8)
        error = raised.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        prompt_tokens = post(server, "/tokenize", {"prompt": "hello " * 5000}).json()["count"]
        assert "4096" in error["message"] and str(prompt_tokens) in error["message"]


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
    # capacity: 2 running + 1 waiting, counted in sequences (prompts x n)
    with Concurrently(client, tokens=96), Concurrently(client, tokens=96):
        # 2 in flight: one more sequence fits, two do not
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt="two too many", max_tokens=4, n=2, temperature=1.0)
        assert raised.value.body["code"] == "queue_full" and raised.value.response.headers["retry-after"] == "1"
        with Concurrently(client, tokens=96):
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
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
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
    command = [sys.executable, "bench/evaluate.py", "--url", server.base, "--lengths", "300", "--depths", "0.5",
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
