"""The checkpoint's own rotary: its per-pair frequency table, attention factor and training length.

A checkpoint declares its rotary in its config (``rope_parameters``, nested per layer type as
Gemma 3 has; older configs: ``rope_theta`` and ``rope_scaling``). It is read here once, as a
float64 table ``θ_ckpt`` of ``d/2`` frequencies, instead of one base number, so that ``none`` is
exactly the checkpoint as trained and every method applies on top of it
(:mod:`rope_plugins.rules.methods`).

Kinds served: ``default`` (``b^(-2i/d)``), ``linear`` (divided by its factor), ``llama3``
(Llama 3.1's per-frequency blend) and ``yarn`` (its NTK-by-parts table, with its attention
factor on q and k). The training length is ``original_max_position_embeddings`` for ``yarn``
(the scaling is applied at inference beyond it) and ``max_position_embeddings`` otherwise:
``linear`` and ``llama3`` checkpoints were trained with their scaled table at that length.

A checkpoint may also declare an extension of its own: Qwen2.5-1M's
``dual_chunk_attention_config`` (``chunk_size``, ``local_size``, trained at its
``original_max_position_embeddings``) is dual-chunk attention, served as the engine's default
settings (:func:`declared_extension`) rather than by the stock model, whose dual-chunk rotary
and attention vLLM's V1 engine no longer runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rope_plugins.rules.rotary import llama3_inv_freq, rope_inv_freq, yarn_attention_factor, yarn_inv_freq

FULL_ATTENTION = "full_attention"  # the layer type whose table the plugin extends (Gemma 3's global layers)
KINDS = ("default", "linear", "llama3", "yarn")


class UnsupportedCheckpoint(ValueError):
    """A checkpoint the plugin cannot serve exactly; the message names the reason."""


@dataclass(frozen=True)
class CheckpointRotary:
    kind: str
    base: float
    head_dim: int
    train_length: int
    theta: tuple[float, ...]  # [d/2] float64 values, a tuple so that the rotary hashes (row-value cache)
    attention_factor: float = 1.0  # stock applies it to q and k: the plugin's query takes its square

    @property
    def frequencies(self) -> torch.Tensor:
        return torch.tensor(self.theta, dtype=torch.float64)

    @classmethod
    def plain(cls, head_dim: int, base: float, train_length: int) -> "CheckpointRotary":
        return cls(kind="default", base=base, head_dim=head_dim, train_length=train_length,
                   theta=tuple(rope_inv_freq(head_dim, base).tolist()))


def rope_parameters(hf_config: Any, layer_type: str = FULL_ATTENTION) -> dict[str, Any]:
    """The rotary parameters of ``layer_type``'s layers, in transformers' ``rope_parameters`` form."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(parameters.get(layer_type), dict):  # one entry per layer type
        parameters = parameters[layer_type]
    if not parameters:  # an older config
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
        parameters = {"rope_type": scaling.pop("type", None) or scaling.pop("rope_type", "default"), **scaling,
                      "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    return dict(parameters)


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def checkpoint_rotary(hf_config: Any, layer_type: str = FULL_ATTENTION) -> CheckpointRotary:
    """The rotary of ``layer_type``'s layers; raises :class:`UnsupportedCheckpoint` naming why."""
    parameters = rope_parameters(hf_config, layer_type)
    kind = parameters.get("rope_type") or "default"
    head_dim, base = head_dim_of(hf_config), float(parameters.get("rope_theta") or 10000.0)
    partial = parameters.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedCheckpoint(f"partial rotation (partial_rotary_factor={partial}) is not served")
    if kind not in KINDS:
        raise UnsupportedCheckpoint(f"rotary kind {kind!r} is not served; served kinds: {', '.join(KINDS)}")
    length = declared_train_length(hf_config)
    attention_factor = 1.0
    if kind == "default":
        theta = rope_inv_freq(head_dim, base)
    elif kind == "linear":
        theta = rope_inv_freq(head_dim, base) / float(parameters["factor"])
    elif kind == "llama3":
        theta = llama3_inv_freq(head_dim, base, float(parameters["factor"]), float(parameters["low_freq_factor"]),
                                float(parameters["high_freq_factor"]),
                                int(parameters["original_max_position_embeddings"]))
    else:
        theta, attention_factor, length = _yarn(parameters, head_dim, base, length)
    return CheckpointRotary(kind=kind, base=base, head_dim=head_dim, train_length=length,
                            theta=tuple(theta.tolist()), attention_factor=attention_factor)


def _yarn(parameters: dict[str, Any], head_dim: int, base: float, length: int) -> tuple[torch.Tensor, float, int]:
    """A checkpoint's declared YaRN: its table, its attention factor, its training length."""
    original = int(parameters.get("original_max_position_embeddings") or length)
    factor = float(parameters.get("factor") or length / original)
    theta = yarn_inv_freq(head_dim, base, factor, original, beta_fast=float(parameters.get("beta_fast") or 32),
                          beta_slow=float(parameters.get("beta_slow") or 1), truncate=parameters.get("truncate", True))
    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
        else:
            attention_factor = yarn_attention_factor(factor)
    return theta, float(attention_factor), original


DUAL_CHUNK_CONFIG = "dual_chunk_attention_config"  # Qwen2.5-1M's


def declared_train_length(hf_config: Any) -> int:
    """``max_position_embeddings``, or the length a declared dual-chunk config was trained at."""
    dual_chunk = getattr(hf_config, DUAL_CHUNK_CONFIG, None) or {}
    return int(dual_chunk.get("original_max_position_embeddings") or hf_config.max_position_embeddings)


def declared_extension(hf_config: Any) -> dict[str, Any]:
    """The extension the checkpoint declares, as settings fields (empty when none): Qwen2.5-1M's
    dual-chunk config is ``dual_chunk`` at its chunk size and local size. Its sparse attention
    (MInference's, in vLLM 0.8's implementation) is not served: every key is attended to."""
    dual_chunk = getattr(hf_config, DUAL_CHUNK_CONFIG, None)
    if not dual_chunk:
        return {}
    try:
        return {"method": "dual_chunk", "chunk_size": int(dual_chunk["chunk_size"]),
                "local_window": int(dual_chunk["local_size"])}
    except (KeyError, TypeError, ValueError) as error:
        raise UnsupportedCheckpoint(f"{DUAL_CHUNK_CONFIG} needs integer chunk_size and local_size: {error!r}") from None
