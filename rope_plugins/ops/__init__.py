"""The attention's numerics, by device: the log-sum-exp merge (any device), the CPU ops
(PyTorch's fused CPU attention, the near-band tiling, the decode in PyTorch) and the C++
decode kernel's typed wrapper. The vLLM classes in :mod:`rope_plugins.attention.backend` call these."""
