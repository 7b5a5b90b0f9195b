"""A tiny random Llama checkpoint for fast exactness tests (fp32, no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

TRAIN_LENGTH = 256
ROPE_BASE = 10000.0


def make_tiny_llama(directory: Path, seed: int = 0, head_dim: int = 32, kv_heads: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=TRAIN_LENGTH, rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
        tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so attention is far from uniform
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0.0, 0.12)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
