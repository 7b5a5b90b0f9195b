"""The plugin's models on vLLM's V2 model runner: each request's settings, by request slot.

V2 tells a model's state (``vllm/v1/worker/gpu/model_states/``) about every request that joins,
on every pipeline rank, with the persistent slot it holds until it leaves; the metadata builder
gathers the step's rows by ``req_idx`` (:func:`rope_plugins.worker.requests.step_tables`). Imported by
:meth:`get_model_state_cls` only, so V1 workers never load the V2 runner's modules.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from rope_plugins.worker.requests import RequestSlots


class RopeExtendModelState(DefaultModelState):
    """vLLM's default state, which every served family would get otherwise (none is
    multimodal, encoder-only, encoder-decoder or Mamba-hybrid; Gemma 3's sliding layers are
    attention too), plus the requests' settings by slot. A slot keeps its last request's
    settings when it frees: a new request always writes its own, and dummy runs' answers are
    thrown away."""

    def __init__(self, vllm_config: VllmConfig, model: nn.Module, encoder_cache: EncoderCache | None,
                 device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.request_settings = RequestSlots(vllm_config)

    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        super().add_request(req_index, new_req_data)
        self.request_settings.add(req_index, new_req_data.sampling_params)
