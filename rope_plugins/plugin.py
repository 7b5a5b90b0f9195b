"""vLLM entry point (``vllm.general_plugins``): registers the extended models and the attention backend.

vLLM loads general plugins in every process it starts, possibly several times: each
registration checks first. Models are registered by class path, so only the processes that
build one import :mod:`rope_plugins.models.families`.
"""

from __future__ import annotations

BACKEND_NAME = "ROPE_EXTEND"
# where the engine's config says which attention ops to run (``additional_config``)
OPS_KEY = "rope_extend_attention_ops"
ATTENTION_OPS = ("cpu", "triton")
# where it says the arithmetic of the CPU attention's bfloat16 dot products (AMX tiles; the
# decode's raw keys by AVX512_BF16; bfloat16 caches only): float32-grade
# operands (two bfloat16 parts each) or each rounded once to bfloat16, as stock vLLM's (the
# default, for its loss and its speed: bench/README.md "Which dtype" and "On a CPU with AMX")
PRECISION_KEY = "rope_extend_attention_precision"
ATTENTION_PRECISIONS = ("float32", "bfloat16")
# vLLM's --kv-cache-dtype names of an fp8 cache (rope_plugins.ops.cpu.FP8_FORMATS: the format of each)
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
DEFAULT_ATTENTION_PRECISION = "bfloat16"


def rounded_once_at(precision: str) -> bool:
    """Whether an attention precision (one of ATTENTION_PRECISIONS) rounds each bfloat16 operand once."""
    return precision == "bfloat16"


# The stock architectures served with rotation moved into the plugin's attention.
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")


def extended_architecture(stock: str) -> str:
    """The registered name of ``stock`` served by the plugin."""
    return f"RopeExtend{stock}"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for family in FAMILIES:
        name = extended_architecture(family)
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"rope_plugins.models.families:{name}")
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "rope_plugins.attention.backend.RopeExtendAttentionBackend")
