"""The stock vLLM model of each family, with rotation moved into the plugin's attention.

For every supported architecture the model is vLLM's own class (weights, norms, biases, q/k
norms, MLP: all stock). After it is built, each full-attention layer's attention is rebuilt on
:class:`~rope_plugins.attention.backend.RopeExtendAttentionBackend` and its rotary embedding becomes a
pass-through, so q and k reach attention unrotated and keys enter the paged cache before
rotation. Sliding-window layers (Gemma 3's local layers) stay stock: their reach is shorter
than training, so no request's setting changes them.

A checkpoint the plugin cannot serve exactly is refused while the model is built, with the
reason (:class:`~rope_plugins.rules.checkpoint.UnsupportedCheckpoint`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.v1.attention.backend import AttentionType

from rope_plugins.attention.backend import RopeExtendAttentionBackend
from rope_plugins.plugin import extended_architecture
from rope_plugins.rules.checkpoint import DUAL_CHUNK_CONFIG, UnsupportedCheckpoint, checkpoint_rotary
from rope_plugins.worker.requests import check_settings_policy


class PassThroughRotary(nn.Module):
    """Where the stock layer rotated q and k: rotation happens inside attention instead."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, *args, **kwargs):
        return query, key


def refuse_unserved(layer: Attention) -> None:
    """What the plugin's attention does not compute, named."""
    if getattr(layer.impl, "logits_soft_cap", None):
        raise UnsupportedCheckpoint(f"{layer.layer_name}: attention logit soft-capping is not served")
    if layer.has_sink:
        raise UnsupportedCheckpoint(f"{layer.layer_name}: attention sinks are not served")
    if layer.attn_type != AttentionType.DECODER:
        raise UnsupportedCheckpoint(f"{layer.layer_name}: only decoder self-attention is served")


def move_rotation_into_attention(model: nn.Module, vllm_config: VllmConfig) -> list[str]:
    """Rebuild every full-attention layer on the plugin's backend with a pass-through rotary;
    returns their names. A layer registers itself under its name in the compilation config's
    forward context: the rebuilt one takes the stock one's place there."""
    forward_context = vllm_config.compilation_config.static_forward_context
    moved = []
    for module in model.modules():
        stock = getattr(module, "attn", None)
        if not isinstance(stock, Attention) or not hasattr(module, "rotary_emb") or stock.sliding_window is not None:
            continue
        refuse_unserved(stock)
        del forward_context[stock.layer_name]
        module.attn = Attention(stock.num_heads, stock.head_size, stock.impl.scale, num_kv_heads=stock.num_kv_heads,
                                cache_config=vllm_config.cache_config, prefix=stock.layer_name,
                                attn_backend=RopeExtendAttentionBackend)
        module.rotary_emb = PassThroughRotary()
        moved.append(stock.layer_name)
    if not moved:
        raise UnsupportedCheckpoint("the model has no full-attention layer with a rotary embedding to extend")
    return moved


def extended(stock: type[nn.Module]) -> type[nn.Module]:
    """``stock`` with its full-attention layers on the plugin's attention."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        hf_config = vllm_config.model_config.hf_config
        if getattr(hf_config, DUAL_CHUNK_CONFIG, None):  # plugin_engine_config turns it into the default settings
            raise UnsupportedCheckpoint(f"its {DUAL_CHUNK_CONFIG} is served as the default dual_chunk settings: start "
                                        "the engine with rope_plugins.frontend.engine_args.engine_kwargs (or "
                                        "python -m rope_plugins.serve), not from the config as it is")
        checkpoint_rotary(hf_config)  # refuses, naming why, a rotary the plugin cannot apply exactly
        check_settings_policy(vllm_config)  # no request reads K/V cached under other settings
        stock.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        move_rotation_into_attention(self, vllm_config)

    def get_model_state_cls() -> type:
        """The V2 model runner's state for this model (the V1 runner never asks)."""
        from rope_plugins.worker.model_state import RopeExtendModelState

        return RopeExtendModelState

    name = extended_architecture(stock.__name__)
    return type(name, (stock,), {"__init__": __init__, "get_model_state_cls": staticmethod(get_model_state_cls),
                                 "__module__": __name__, "__qualname__": name})


RopeExtendLlamaForCausalLM = extended(LlamaForCausalLM)
RopeExtendMistralForCausalLM = extended(MistralForCausalLM)
RopeExtendQwen2ForCausalLM = extended(Qwen2ForCausalLM)
RopeExtendQwen3ForCausalLM = extended(Qwen3ForCausalLM)
RopeExtendGemma3ForCausalLM = extended(Gemma3ForCausalLM)
