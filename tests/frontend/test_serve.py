"""The plugin under stock ``vllm serve`` (rope_plugins/serve.py).

One server for the module: the command ``python -m rope_plugins.serve`` prints for the tiny
random Llama (default ReRoPE, window 37, served to 4x its training length), prefix caching on as
vLLM's default, checked over HTTP against the float64 oracle: the default method is served, the
default named in ``vllm_xargs`` is served and shares the prefix cache, other settings are refused
(they could share blocks computed under other settings), a bad setting is a 400 naming its field
and the server goes on. Without a server: the admission rules with prefix caching on and off, the
flat ``vllm_xargs`` form on the worker, the engine-start policy, and the printed flags read by
vLLM's own parser.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate

from rope_plugins import serve
from rope_plugins.frontend.engine_args import compute_on_every_core, engine_kwargs
from rope_plugins.plugin import PRECISION_KEY
from rope_plugins.rules.settings import EXTRA_ARGS_KEY, SALTED_KEY, ExtensionSettings, SettingsError, request_fields
from rope_plugins.testing.launcher import ServerProcess, free_port
from rope_plugins.worker.requests import RequestSettingsTracker, check_settings_policy
from tests.conftest import ENGINE_DEFAULTS, MAX_MODEL_LEN
from tests.frontend.test_engine_args import LOGPROB_TOLERANCE, NEW_TOKENS, assert_close_logprobs, prompt
from tests.support.tiny_models import TRAIN_LENGTH
from tests.worker.test_requests import engine_config

ROOT = Path(__file__).resolve().parents[2]
WINDOW = ENGINE_DEFAULTS["window"]
DEFAULT_XARGS = {"context_extension.method": "rerope", "context_extension.window": WINDOW}


def xargs(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=1, extra_args={f"context_extension.{name}": value
                                                    for name, value in fields.items()})


# ---- without a server ------------------------------------------------------------------------

def test_the_flat_form_gathers_one_object():
    assert request_fields(xargs(method="rerope", window=64)) == {"method": "rerope", "window": 64}
    assert request_fields(xargs(log_n=1)) == {"log_n": True}  # vllm_xargs turns JSON true into 1
    assert request_fields(SamplingParams(extra_args={EXTRA_ARGS_KEY: {"window": 8}})) == {"window": 8}
    assert request_fields(SamplingParams(extra_args={"other": 1})) is None
    with pytest.raises(SettingsError, match="not both") as both:
        request_fields(SamplingParams(extra_args={EXTRA_ARGS_KEY: {"window": 8}, "context_extension.window": 9}))
    assert both.value.parameter == EXTRA_ARGS_KEY


def test_the_worker_runs_the_flat_form():
    tracker = RequestSettingsTracker(engine_config(), torch.device("cpu"), False)
    params = xargs(method="leaky_rerope", window=100, leaky_k=4.0, log_n=1)
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, params, None, [])], moved=[]))
    assert tracker.settings[1].canonical() == {"method": "leaky_rerope", "window": 100, "leaky_k": 4.0,
                                               "log_n": True, "train_length": tracker.defaults.train_length}
    assert tracker.tables.window[1] == 100 and tracker.tables.leak[1] == 0.25


def refused(params: SamplingParams) -> VLLMValidationError:
    with pytest.raises(VLLMValidationError) as caught:
        serve.admit(params)
    return caught.value


@pytest.fixture
def engine_facts(monkeypatch):
    """Admission as in an API server whose EngineSettings middleware saw the engine."""

    def served(prefix_caching: bool) -> ExtensionSettings:
        defaults = ExtensionSettings(train_length=TRAIN_LENGTH, **ENGINE_DEFAULTS)
        monkeypatch.setattr(serve, "_engine", serve.EngineFacts(defaults, prefix_caching))
        return defaults

    return served


def test_with_prefix_caching_only_the_default_is_admitted(engine_facts):
    engine_facts(prefix_caching=True)
    serve.admit(SamplingParams())
    serve.admit(xargs(method="rerope", window=WINDOW))
    serve.admit(xargs(window=WINDOW, factor=2.0))  # a field rerope does not read: the same computation
    for other in (xargs(method="ntk_mixed"), xargs(window=WINDOW + 1), xargs(log_n=True),
                  SamplingParams(extra_args={EXTRA_ARGS_KEY: {"method": "yarn"}})):  # the object form too
        error = refused(other)
        assert error.parameter == EXTRA_ARGS_KEY
        assert "prefix caching" in str(error) and "--no-enable-prefix-caching" in str(error)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_bad_settings_are_refused_against_the_engines_defaults(engine_facts, prefix_caching):
    engine_facts(prefix_caching)
    error = refused(xargs(window=TRAIN_LENGTH))  # valid anywhere but on this checkpoint
    assert error.parameter == "context_extension.window" and f"train_length ({TRAIN_LENGTH})" in str(error)
    assert refused(xargs(method="pi", factor="auto")).parameter == "context_extension.factor"
    assert refused(xargs(method="warp")).parameter == "context_extension.method"


def test_without_prefix_caching_every_valid_setting_is_admitted(engine_facts):
    engine_facts(prefix_caching=False)
    serve.admit(xargs(method="ntk_mixed", factor=3.0, log_n=1))
    serve.admit(SamplingParams(extra_args={EXTRA_ARGS_KEY: {"method": "yarn", "factor": 2.0}}))


def test_without_the_engines_settings_no_per_request_setting_is_admitted(monkeypatch):
    monkeypatch.setattr(serve, "_engine", None)
    serve.admit(SamplingParams())
    error = refused(xargs(method="rerope", window=WINDOW))
    assert error.parameter == EXTRA_ARGS_KEY and "--middleware rope_plugins.serve.EngineSettings" in str(error)


def policy_config(*processors, prefix_caching=True, **additional):
    return SimpleNamespace(model_config=SimpleNamespace(logits_processors=list(processors)),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
                           additional_config=additional)


def test_an_engine_that_could_mix_settings_in_its_prefix_cache_does_not_start():
    check_settings_policy(policy_config("rope_plugins.serve:SettingsTracker"))
    check_settings_policy(policy_config(serve.SettingsAdmission))
    check_settings_policy(policy_config(RequestSettingsTracker, **{SALTED_KEY: True}))  # engine_kwargs'
    check_settings_policy(policy_config("rope_plugins.worker.requests:RequestSettingsTracker", prefix_caching=False))
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        check_settings_policy(policy_config("rope_plugins.worker.requests:RequestSettingsTracker"))
    with pytest.raises(ValueError, match="no request-settings processor"):
        check_settings_policy(policy_config(prefix_caching=False))


def test_the_printed_command_is_engine_kwargs_read_by_vllms_parser(tiny_llama_dir, capsys):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve.main([str(tiny_llama_dir), "--method", "rerope", "--window", str(WINDOW), "--max-model-len",
                str(MAX_MODEL_LEN), "--no-enable-prefix-caching", "--attention-precision", "bfloat16",
                "--kv-cache-dtype", "fp8_e5m2"])
    words = shlex.split(capsys.readouterr().out.replace("\\\n", " "))  # as the shell reads its continued lines
    flags = words[words.index("--max-model-len"):]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(tiny_llama_dir), *flags])
    ours = engine_kwargs(str(tiny_llama_dir), defaults=ENGINE_DEFAULTS, max_model_len=MAX_MODEL_LEN)
    assert args.hf_overrides == ours["hf_overrides"] and args.max_model_len == ours["max_model_len"]
    assert args.logits_processors == ["rope_plugins.serve:SettingsTracker"]
    assert args.middleware == ["rope_plugins.serve.EngineSettings"]
    assert args.enable_prefix_caching is False
    assert args.additional_config == {PRECISION_KEY: "bfloat16"}
    assert args.kv_cache_dtype == "fp8_e5m2"


def test_every_numeric_setting_is_a_default_flag(tiny_llama_dir, capsys):
    """STRING's and dual-chunk's fields too: each flag reaches the engine's default settings."""
    serve.main([str(tiny_llama_dir), "--method", "dual_chunk", "--chunk-size", "138", "--local-window", "10",
                "--shift", "90", "--local", "7", "--max-model-len", str(MAX_MODEL_LEN)])
    words = shlex.split(capsys.readouterr().out.replace("\\\n", " "))
    overrides = json.loads(words[words.index("--hf-overrides") + 1])
    assert {name: overrides["rope_extension"][name] for name in ("method", "chunk_size", "local_window", "shift",
                                                                 "local")} == {
        "method": "dual_chunk", "chunk_size": 138, "local_window": 10, "shift": 90, "local": 7}


# ---- one vllm serve process --------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    groups = serve.serve_command(str(tiny_llama_dir), defaults=ENGINE_DEFAULTS, max_model_len=MAX_MODEL_LEN)
    command = [word for group in groups for word in group]
    if command[0] == "vllm":  # the console script of this venv
        command[0] = str(Path(sys.executable).with_name("vllm"))
    port = free_port()
    command += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
                "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(1 << 27),
                "--max-num-seqs", "4", "--seed", "0", "--enable-prompt-tokens-details"]
    compute_on_every_core()
    log = tmp_path_factory.mktemp("vllm_serve") / "vllm_serve.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ), stdout=output, stderr=subprocess.STDOUT)
    running = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.time() + 600
    while True:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited (code {process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{running.base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            running.stop()
            pytest.fail(f"vllm serve was not healthy in 600 s:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    running.model = str(tiny_llama_dir)
    yield running
    running.stop()


def complete(server, ids: list[int], vllm_xargs: dict | None = None, **body) -> httpx.Response:
    body = {"model": server.model, "prompt": ids, "max_tokens": 1, "temperature": 0, **body}
    if vllm_xargs is not None:
        body["vllm_xargs"] = vllm_xargs
    return httpx.post(f"{server.base}/v1/completions", json=body, timeout=300)


def prompt_logprobs(response: httpx.Response, ids: list[int]) -> torch.Tensor:
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])], dtype=torch.float64)


def assert_refused(response: httpx.Response, parameter: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == parameter and all(word in error["message"] for word in words), error
    return error["message"]


PAST_TRAINING = 300  # prompt tokens: past the training length (256), far past the window (37)


@pytest.mark.slow
def test_vllm_serve_serves_the_default_method(server, reference_model, engine_defaults):
    ids = prompt(700, PAST_TRAINING)
    served = prompt_logprobs(complete(server, ids, prompt_logprobs=0), ids)
    assert_close_logprobs(served, reference_model.prompt_logprobs(ids, engine_defaults), "vllm serve's default")
    plain = reference_model.prompt_logprobs(ids, ExtensionSettings(train_length=TRAIN_LENGTH))
    assert_close_logprobs(served[:WINDOW - 1], plain[:WINDOW - 1], "inside the window: plain RoPE")
    assert (served - plain)[WINDOW:].abs().max() > 100 * LOGPROB_TOLERANCE, "plain RoPE served, not ReRoPE"
    named = prompt_logprobs(complete(server, ids, DEFAULT_XARGS, prompt_logprobs=0), ids)
    assert_close_logprobs(named, served, "the default named in vllm_xargs")


@pytest.mark.slow
def test_only_the_default_reads_the_prefix_cache(server, reference_model, engine_defaults):
    """A prompt cached under the default: a request under other settings is refused before the
    cache (with why and what to do); the default named in vllm_xargs reuses it, rightly."""
    ids = prompt(701, PAST_TRAINING)
    assert complete(server, ids).status_code == 200  # caches the prompt's blocks
    for other in ({"context_extension.method": "ntk_mixed"}, {"context_extension.window": WINDOW + 1},
                  {"context_extension.log_n": True}):
        assert_refused(complete(server, ids, other), EXTRA_ARGS_KEY, "prefix caching", "--no-enable-prefix-caching")
    hit = complete(server, ids, DEFAULT_XARGS, max_tokens=NEW_TOKENS, return_token_ids=True, ignore_eos=True)
    assert hit.status_code == 200, hit.text
    answer = hit.json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    tokens = answer["choices"][0]["token_ids"]  # (log-probabilities of generated tokens need a tokenizer)
    assert tokens == reference_model.continuation(ids, tokens, engine_defaults)[1], "greedy, as the oracle's"


@pytest.mark.slow
def test_a_bad_setting_is_a_400_naming_its_field_and_the_server_goes_on(server):
    ids = prompt(702, 64)
    # refused against the engine's training length: admission has the engine's settings
    assert_refused(complete(server, ids, {"context_extension.window": TRAIN_LENGTH}), "context_extension.window",
                   f"smaller than train_length ({TRAIN_LENGTH})")
    assert_refused(complete(server, ids, {"context_extension.method": "warp"}), "context_extension.method",
                   "unknown method")
    assert_refused(complete(server, ids, {"context_extension.factor": "auto", "context_extension.method": "pi"}),
                   "context_extension.factor", "give a number")
    assert complete(server, ids).status_code == 200
