"""Llama-family model whose attention rotates inside the attention backend.

The decoder layers, MLP, norms and weight names are vLLM's own Llama (``LlamaDecoderLayer``
takes the attention module as ``attn_layer_type``); only the attention module differs: it
projects q, k, v and hands them to :class:`~rope_plugins.attention.RopeExtendAttentionBackend`
unrotated, so keys enter the paged cache before rotation.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.v1.attention.backend import AttentionType

from .attention import RopeExtendAttentionBackend


class RopeExtendLlamaAttention(nn.Module):
    """q/k/v projection, pre-rotation attention, output projection (Llama's weight names)."""

    def __init__(self, config, hidden_size: int, num_heads: int, num_kv_heads: int,
                 max_position_embeddings: int = 8192, quant_config: QuantizationConfig | None = None,
                 bias: bool = False, bias_o_proj: bool = False, cache_config: CacheConfig | None = None,
                 prefix: str = "", attn_type: str = AttentionType.DECODER) -> None:
        super().__init__()
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in (None, "default"):
            raise ValueError(f"rope_plugins serves checkpoints with plain RoPE; this one has rope_type={rope_type!r}")
        tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size=hidden_size, head_size=self.head_dim,
                                          total_num_heads=num_heads, total_num_kv_heads=num_kv_heads,
                                          bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(input_size=num_heads * self.head_dim, output_size=hidden_size,
                                        bias=bias_o_proj, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn",
                              attn_type=attn_type, attn_backend=RopeExtendAttentionBackend)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # No rotation here: each request's rule is applied inside attention.
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class RopeExtendLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         layer_type=partial(LlamaDecoderLayer, attn_layer_type=RopeExtendLlamaAttention))
