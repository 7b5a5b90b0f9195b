"""vLLM entry point (``vllm.general_plugins``): registers the model and the attention backend.

vLLM loads general plugins in every process it starts, possibly several times: each
registration checks first. The model is registered by its class path, so only the
processes that build it import it.
"""

from __future__ import annotations

BACKEND_NAME = "ROPE_EXTEND"
ARCHITECTURE = "RopeExtendLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "rope_plugins.model:RopeExtendLlamaForCausalLM")
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "rope_plugins.attention.RopeExtendAttentionBackend")
