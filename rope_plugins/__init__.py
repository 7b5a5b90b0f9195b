"""RoPE context-extension plugin for vLLM."""
