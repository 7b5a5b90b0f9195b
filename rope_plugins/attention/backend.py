"""The attention backend: a pre-rotation paged KV cache and per-request position rules.

Keys are written to the cache **unrotated** (K and V planes only, as stock vLLM) and rotated
inside attention by each request's own rule (:mod:`rope_plugins.rules.methods`). This module holds
vLLM's classes only: the metadata builder asks :class:`~rope_plugins.attention.planner.StepPlanner` for
the step's plan, and the impl runs the ops of :mod:`rope_plugins.ops.cpu` on it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from rope_plugins.attention.planner import KernelPlan, StepPlan, StepPlanner, kernel_plan
from rope_plugins.ops import cpu
from rope_plugins.plugin import (
    ATTENTION_PRECISIONS,
    BACKEND_NAME,
    DEFAULT_ATTENTION_PRECISION,
    OPS_KEY,
    PRECISION_KEY,
    rounded_once_at,
)
from rope_plugins.worker.requests import step_tables
from rope_plugins.worker.row_tables import RowTables


def runs_triton(vllm_config: VllmConfig, device: torch.device) -> bool:
    """CUDA tensors take the Triton kernels; CPU ones too when the engine's config says so."""
    return device.type == "cuda" or (vllm_config.additional_config or {}).get(OPS_KEY) == "triton"


def rounded_once_in(vllm_config: VllmConfig | None) -> bool:
    """Whether the CPU attention's bfloat16 dot products (AMX tiles; the decode's raw keys) take each
    operand rounded once to bfloat16 (the engine's ``PRECISION_KEY`` is ``"bfloat16"``, the
    default; also without an engine, as the tests build the impl) rather than as two bfloat16 parts
    (``"float32"``). Raises ValueError on any other value."""
    config = (vllm_config.additional_config if vllm_config else None) or {}
    precision = config.get(PRECISION_KEY, DEFAULT_ATTENTION_PRECISION)
    if precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"additional_config {PRECISION_KEY} must be one of {ATTENTION_PRECISIONS}, not {precision!r}")
    return rounded_once_at(precision)


class RopeExtendMetadataBuilder(AttentionMetadataBuilder[StepPlan | KernelPlan]):
    """The step's plan from its rows and each row's settings, once per step for all layers:
    a :class:`KernelPlan` for the Triton kernels, a :class:`StepPlan` (that same rule and the
    rotation tables made from it) for the CPU ops."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vllm_config = vllm_config
        self.planner = StepPlanner(block_size=kv_cache_spec.block_size)
        self.triton = runs_triton(vllm_config, device)

    def tables(self, common: CommonAttentionMetadata) -> RowTables:
        """Each row's settings (row i: batch row i), from the V1 tracker or the V2 model state."""
        return step_tables(self.vllm_config, common)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StepPlan | KernelPlan:
        common = common_attn_metadata
        rows = common.num_reqs
        if self.triton:
            return kernel_plan(self.tables(common), query_start_cpu=common.query_start_loc_cpu,
                               query_start=common.query_start_loc, seq_lens=common.seq_lens[:rows],
                               max_seq_len=common.max_seq_len, block_table=common.block_table_tensor,
                               slot_mapping=common.slot_mapping[: common.num_actual_tokens])
        return self.planner.plan(self.tables(common), common.query_start_loc_cpu[: rows + 1].to(torch.int64),
                                 common.seq_lens[:rows].to("cpu", torch.int64), common.block_table_tensor,
                                 common.slot_mapping[: common.num_actual_tokens])


class RopeExtendAttentionImpl(AttentionImpl[StepPlan | KernelPlan]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("rope_plugins attention: no ALiBi, sliding window or soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("rope_plugins attention serves decoder self-attention only")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = cpu.FP8_FORMATS.get(kv_cache_dtype)  # None: the cache holds the model's dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.use_kernel = True  # the tests switch it off to hold the plain PyTorch path against the oracle
        config = get_current_vllm_config_or_none()
        self.rounded_once = rounded_once_in(config)
        if not torch.cuda.is_available():
            cpu.built_kernels()  # build or load them now, at model construction, not inside the first step

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: StepPlan | KernelPlan | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output
        plan = attn_metadata
        tokens = plan.num_actual_tokens
        query, key, value = query[:tokens], key[:tokens], value[:tokens]
        scales = cpu.CacheScales()
        if self.fp8 is not None:  # vLLM allocates an fp8 cache as bytes
            kv_cache, scales = kv_cache.view(self.fp8), cpu.CacheScales(layer._k_scale_float, layer._v_scale_float)
        if isinstance(plan, KernelPlan):
            from rope_plugins.ops import gpu  # imports Triton: only where the kernels run

            scaled = dict(key_scale=scales.key, value_scale=scales.value)
            if self.kv_sharing_target_layer_name is None:
                gpu.write_cache(key, value, kv_cache, plan.slot_mapping, **scaled)
            gpu.prefill(query, kv_cache, plan, output, scale=self.scale, **scaled)
            gpu.decode(query, kv_cache, plan, output, scale=self.scale, **scaled)
            return output
        if self.kv_sharing_target_layer_name is None:
            cpu.write_cache(key, value, kv_cache, plan.slot_mapping, use_kernel=self.use_kernel, scales=scales)
        if plan.decode is not None:
            output[plan.decode.tokens] = cpu.decode(query[plan.decode.tokens], kv_cache, plan.decode, plan.query,
                                                    scale=self.scale, use_kernel=self.use_kernel,
                                                    rounded_once=self.rounded_once, scales=scales)
        for row in plan.prefill:
            output[row.tokens] = cpu.prefill(query[row.tokens], plan.query, kv_cache, plan.block_table[row.row], row,
                                             scale=self.scale, use_kernel=self.use_kernel,
                                             rounded_once=self.rounded_once, scales=scales)
        return output


class RopeExtendAttentionBackend(AttentionBackend):
    """Attention for the RoPE-extension model: owns the cache write and the read."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # "auto": the model's dtype; fp8: keys and values quantized per tensor (rope_plugins.ops.cpu.quantized)
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *cpu.FP8_FORMATS]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[RopeExtendAttentionImpl]:
        return RopeExtendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RopeExtendMetadataBuilder]:
        return RopeExtendMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # head-major blocks first, as stock vLLM's CPU cache: one head's keys of a block are one
        # contiguous run, which the C++ kernels read per head (decode reads each row once, so
        # interleaved heads would cost it memory bandwidth). Token-major works too (any strides).
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
