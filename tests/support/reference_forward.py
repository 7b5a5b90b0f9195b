"""A reference forward of a checkpoint in transformers with the oracle attention.

transformers' own model of the checkpoint's family runs with its rotary embedding made the
identity on full-attention layers (so q and k reach attention unrotated) and an attention
function, registered through transformers' AttentionInterface, that calls
:func:`rope_plugins.testing.reference.reference_attention` there; sliding-window layers (Gemma 3's
local ones) keep transformers' own rotation and attention.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.testing.reference import UnrotatedRotaryEmbedding, reference_attention

ATTENTION_NAME = "rope_oracle"


def sliding_window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                             scaling: float) -> torch.Tensor:
    """Plain causal attention over the last ``window`` keys (``m - n < window``), float64:
    query ``[1, H, L, d]``, key/value ``[1, Hkv, L, d]`` -> ``[1, L, H, d]``."""
    group = query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(group, dim=1), value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ key.transpose(-1, -2) * scaling
    distance = torch.arange(query.shape[2])[:, None] - torch.arange(key.shape[2])[None, :]
    scores = scores.masked_fill((distance < 0) | (distance >= window), float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2).to(query.dtype)


class ReferenceModel:
    """``cached``: what the KV cache makes of a key or value before attention reads it (an fp8
    cache's quantization; None: nothing), applied to the unrotated keys as the plugin caches them."""

    def __init__(self, directory: Path, cached: Callable[[torch.Tensor], torch.Tensor] | None = None):
        from transformers import AttentionInterface, AutoModelForCausalLM

        self.settings: ExtensionSettings | None = None
        self.cached = cached
        # transformers' attention registry is global: a name of its own per model, or the model
        # built last would answer for every earlier one (its settings, its rotary)
        name = f"{ATTENTION_NAME}_{id(self):x}"
        AttentionInterface.register(name, self._attention)
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=name)
        self.model.eval()
        config = self.model.config
        rope = config.rope_parameters
        self.rope = dict(rope.get("full_attention", rope))  # the global layers' rotary (nested per layer type)
        self.base = float(self.rope["rope_theta"])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.model.model.rotary_emb = UnrotatedRotaryEmbedding(head_dim, self.model.model.rotary_emb)

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if getattr(module, "is_sliding", False):  # a stock local layer: q and k arrive rotated
            return sliding_window_attention(query, key, value, module.sliding_window, scaling), None
        # query [1, H, L, d], key/value [1, Hkv, L, d] -> [1, L, H, d]
        if self.cached is not None:
            key, value = self.cached(key), self.cached(value)
        out = reference_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  self.settings, base=self.base, rope=self.rope, softmax_scale=scaling)
        return out[None], None

    @torch.no_grad()
    def logits(self, token_ids: list[int], settings: ExtensionSettings) -> torch.Tensor:
        self.settings = settings
        return self.model(torch.tensor([token_ids])).logits[0].double()

    def prompt_logprobs(self, token_ids: list[int], settings: ExtensionSettings) -> torch.Tensor:
        """log p(token_i | tokens_<i) for i >= 1."""
        return self.answer(token_ids, [], settings)[0]

    def continuation(self, token_ids: list[int], generated: list[int],
                     settings: ExtensionSettings) -> tuple[torch.Tensor, list[int]]:
        """log p(generated_j | all before it), and the greedy choice after each prefix (what
        greedy decoding picks at step j)."""
        return self.answer(token_ids, generated, settings)[1:]

    def answer(self, token_ids: list[int], generated: list[int],
               settings: ExtensionSettings) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """In one forward over ``token_ids + generated`` (attention is causal, so a position's
        answer never depends on what follows it): the prompt's log-probabilities, the generated
        tokens' and greedy's choice after each prefix."""
        logprobs = self.logits(token_ids + generated, settings).log_softmax(-1)
        following = torch.tensor(token_ids[1:] + generated)[:, None]
        chosen = logprobs[:-1].gather(1, following)[:, 0]
        prompt = len(token_ids) - 1
        return chosen[:prompt], chosen[prompt:], logprobs[prompt:-1].argmax(-1).tolist()
