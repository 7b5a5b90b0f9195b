"""A reference forward of a checkpoint in transformers with the oracle attention.

transformers' own Llama runs with its rotary embedding made the identity (so q and k reach
attention unrotated) and an attention function, registered through transformers'
AttentionInterface, that calls :func:`rope_plugins.reference.reference_attention`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rope_plugins.reference import UnrotatedRotaryEmbedding, reference_attention
from rope_plugins.settings import ExtensionSettings

ATTENTION_NAME = "rope_oracle"


class ReferenceModel:
    def __init__(self, directory: Path):
        from transformers import AttentionInterface, LlamaForCausalLM

        self.settings: ExtensionSettings | None = None
        AttentionInterface.register(ATTENTION_NAME, self._attention)
        self.model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32, attn_implementation=ATTENTION_NAME)
        self.model.eval()
        config = self.model.config
        self.base = float(config.rope_parameters["rope_theta"])
        self.model.model.rotary_emb = UnrotatedRotaryEmbedding(config.head_dim)

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [1, H, L, d], key/value [1, Hkv, L, d] -> [1, L, H, d]
        out = reference_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  self.settings, base=self.base, softmax_scale=scaling)
        return out[None], None

    @torch.no_grad()
    def logits(self, token_ids: list[int], settings: ExtensionSettings) -> torch.Tensor:
        self.settings = settings
        return self.model(torch.tensor([token_ids])).logits[0].double()

    def prompt_logprobs(self, token_ids: list[int], settings: ExtensionSettings) -> torch.Tensor:
        """log p(token_i | tokens_<i) for i >= 1."""
        logprobs = self.logits(token_ids, settings).log_softmax(-1)
        return logprobs[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]

    def continuation(self, token_ids: list[int], generated: list[int],
                     settings: ExtensionSettings) -> tuple[torch.Tensor, list[int]]:
        """In one forward over ``token_ids + generated``: log p(generated_j | all before it),
        and the greedy choice after each prefix (what greedy decoding picks at step j)."""
        logprobs = self.logits(token_ids + generated, settings).log_softmax(-1)[len(token_ids) - 1: -1]
        return logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0], logprobs.argmax(-1).tolist()
