"""Tiny random checkpoints of each served architecture for fast exactness tests (fp32, no
tokenizer): the real layout of each family (biases, q/k norms, GQA, head sizes, Gemma 3's
sliding and global layers) at a few hundred thousand parameters."""

from __future__ import annotations

from pathlib import Path

import torch

TRAIN_LENGTH = 256
ROPE_BASE = 10000.0
PLAIN_ROPE = {"rope_type": "default", "rope_theta": ROPE_BASE}
# A Llama 3.1-style table on the tiny model: scaled below 64 / 1 tokens of wavelength.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": ROPE_BASE, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SLIDING_WINDOW = 48  # Gemma 3's local layers: shorter than the prompts, not a multiple of the block size


def family_config(family: str, rope: dict | None = None):
    """The config of a tiny ``family`` checkpoint; what each one exercises is in the comment."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=256, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=TRAIN_LENGTH,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    rope = dict(rope or PLAIN_ROPE)
    if family == "llama":  # head dim 32, GQA 2:1
        return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           rope_parameters=rope, **common)
    if family == "mistral":  # Llama's layout, v0.2+: no sliding window
        return MistralConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             sliding_window=None, rope_parameters=rope, **common)
    if family == "qwen2":  # q/k/v biases, GQA 7:1, head dim 64 (Qwen2.5-0.5B's 14/2 heads)
        return Qwen2Config(hidden_size=448, num_attention_heads=7, num_key_value_heads=1, rope_parameters=rope,
                           **common)
    if family == "qwen3":  # q/k norms before rotation, head dim 128
        return Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           rope_parameters=rope, **common)
    if family == "gemma3":  # head dim 256, sliding local layers (base 1e4) around a global one (base 1e6)
        return Gemma3TextConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                query_pre_attn_scalar=256, sliding_window=SLIDING_WINDOW,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                **{**common, "num_hidden_layers": 3})
    raise ValueError(f"no tiny {family}")


def make_tiny_model(directory: Path, family: str = "llama", seed: int = 0, rope: dict | None = None,
                    config: dict | None = None) -> Path:
    """A tiny ``family`` checkpoint in ``directory``; ``config``: attributes set on its config
    (what transformers' model of the family does not read, such as Qwen2.5-1M's dual-chunk config)."""
    from transformers import AutoModelForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    declared = family_config(family, rope)
    for name, value in (config or {}).items():
        setattr(declared, name, value)
    model = AutoModelForCausalLM.from_config(declared, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so attention is far from uniform
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0.0, 0.12)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
