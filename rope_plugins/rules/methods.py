"""Every context-extension method in one table.

Each method is one general rule (DESIGN.md): the query at position ``m`` scores the key at
``n`` at the relative position ``r = m - n`` when ``r < w`` (the near window), and beyond it
at ``o + (r - w) ρ``, which is the far query at position ``o + (m - w) ρ`` against the far key
at ``n ρ``; with the method's frequencies ``θ`` and a factor on the query. The far positions
start where the near ones end (``o = w``) but in STRING, which moves them down to start at its
local value (``w = S``, ``o = W``, ``ρ = 1``: ``r`` below ``S``, else ``r - S + W``). Frequency methods
have no window (``w = 0, ρ = 1``) and change ``θ``; ReRoPE has ``ρ = 0`` (old keys read raw
against one pre-rotated query) and Leaky ReRoPE ``ρ = 1/k``. Self-Extend (LongLM) groups
positions: ``ρ = 1/g`` with each far position floored to its group, the far query at
``⌊m/g⌋ + w - ⌊w/g⌋`` against the far key at ``⌊n/g⌋``. Dynamic NTK changes ``θ`` with the
query's position: ``θ_i k^(-e_i)`` with ``k`` sized to the tokens the query has seen, applied to
every key it reads (keys are cached unrotated, so each step's rotation is exact).

Dual-chunk attention (ChunkLlama, An et al., ICML 2024) cuts positions into chunks of
``s = C - l`` (``C`` its chunk size, ``l`` its local window): every key stands at ``n mod s``; a
query scores keys of its own chunk at ``m mod s``, of the chunk before at ``min(m mod s + s, C)``
and older ones at ``C``. In relative terms a key is near (``r = m - n``) when it shares the
query's chunk, or is in the chunk before and ``m mod s <= l``; every other key is far, at
``C - n mod s``: the far query stands at ``o = C`` whatever ``m``, the far key at ``n mod s``
(``ρ = 1`` within a chunk), and the window follows the query, ``w(m) = m mod s + 1`` plus ``s``
when ``m mod s <= l`` (``planner.query_windows``; its ``w`` here is the widest, ``C + 1``).

Frequencies apply on top of the checkpoint's own table (:mod:`rope_plugins.rules.checkpoint`):
a method multiplies each pair of ``θ_ckpt`` by the factor it applies to plain RoPE at the
checkpoint's base, ``θ_method(b) / θ_plain(b)`` (YaRN's ramp at the request's training
length). For a plain checkpoint that is the method's own table; for a scaled one (llama3,
linear, yarn) the method scales what the checkpoint was trained with.

Settings validation (the method names, the fields a method uses and so its canonical hash),
the worker's per-row tables and the attention read this table; the oracle
(:mod:`rope_plugins.testing.reference`) is written from the formulas on its own. A new method is one
entry here, its kernel support, and a test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rope_plugins.rules.rotary import (
    ntk_dynamic_exponent,
    ntk_fixed_inv_freq,
    ntk_mixed_inv_freq,
    ntk_old_inv_freq,
    pi_inv_freq,
    rope_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
)

if TYPE_CHECKING:
    from rope_plugins.rules.checkpoint import CheckpointRotary
    from rope_plugins.rules.settings import ExtensionSettings


def _plain_frequencies(settings: ExtensionSettings, head_dim: int, base: float) -> torch.Tensor:
    return rope_inv_freq(head_dim, base)


def _no_window(settings: ExtensionSettings) -> int:
    return 0


def _full_leak(settings: ExtensionSettings) -> float:
    return 1.0


def _far_from_window(settings: ExtensionSettings) -> int | None:
    return None  # o = w


def _unit_query_factor(settings: ExtensionSettings) -> float:
    return 1.0


def _ungrouped(settings: ExtensionSettings) -> int:
    return 0


def _unchunked(settings: ExtensionSettings) -> int:
    return 0


def _fixed_factor(settings: ExtensionSettings, head_dim: int) -> torch.Tensor | None:
    return None


@dataclass(frozen=True)
class ExtensionMethod:
    """One method: the settings fields it reads, and its rules as functions of the settings."""

    name: str
    fields: tuple[str, ...]  # the settings it uses: the canonical form (and hash) keeps only these
    # θ on plain RoPE at base b (head dim d), [d/2] float64
    frequencies: Callable[[ExtensionSettings, int, float], torch.Tensor] = _plain_frequencies
    window: Callable[[ExtensionSettings], int] = _no_window  # w: keys closer than this score plain RoPE
    leak: Callable[[ExtensionSettings], float] = _full_leak  # ρ: how far positions advance beyond w
    # o: where the far relative positions start; None: at the window (o = w)
    far_origin: Callable[[ExtensionSettings], int | None] = _far_from_window
    query_factor: Callable[[ExtensionSettings], float] = _unit_query_factor  # on every query (before log-n)
    # g: far positions floored to whole groups of g (then ρ = 1/g); 0 keeps them continuous
    group: Callable[[ExtensionSettings], int] = _ungrouped
    # a factor k that follows the length: θ_i k^(-e_i) at each query, with k from the tokens it
    # has seen (rotary.dynamic_length); returns e, [d/2] float64, or None for a fixed θ
    dynamic_exponent: Callable[[ExtensionSettings, int], torch.Tensor | None] = _fixed_factor
    # s: keys stand at n mod s for far queries, and the window follows the query (dual-chunk); 0: no chunks
    chunk_length: Callable[[ExtensionSettings], int] = _unchunked


METHODS: dict[str, ExtensionMethod] = {method.name: method for method in (
    ExtensionMethod("none", ()),
    ExtensionMethod("pi", ("factor",), frequencies=lambda s, d, b: pi_inv_freq(d, b, s.factor)),
    ExtensionMethod("ntk_old", ("factor",), frequencies=lambda s, d, b: ntk_old_inv_freq(d, b, s.factor)),
    ExtensionMethod("ntk_fixed", ("factor",), frequencies=lambda s, d, b: ntk_fixed_inv_freq(d, b, s.factor)),
    ExtensionMethod("ntk_mixed", ("factor", "beta"),
                    frequencies=lambda s, d, b: ntk_mixed_inv_freq(d, b, s.factor, s.beta)),
    # YaRN scales q and k each by its attention factor, so the logits by its square
    ExtensionMethod("yarn", ("factor", "train_length"),
                    frequencies=lambda s, d, b: yarn_inv_freq(d, b, s.factor, s.train_length),
                    query_factor=lambda s: yarn_attention_factor(s.factor) ** 2),
    ExtensionMethod("rerope", ("window",), window=lambda s: s.window, leak=lambda s: 0.0),
    ExtensionMethod("leaky_rerope", ("window", "leaky_k"), window=lambda s: s.window, leak=lambda s: 1.0 / s.leaky_k),
    ExtensionMethod("self_extend", ("window", "group"), window=lambda s: s.window, leak=lambda s: 1.0 / s.group,
                    group=lambda s: s.group),
    # its θ here is plain RoPE's, the factor 1 of every query within training
    ExtensionMethod("ntk_dynamic", ("train_length",), dynamic_exponent=lambda s, d: ntk_dynamic_exponent(d)),
    # STRING: relative positions from the shift S on start again at the local value W
    ExtensionMethod("string", ("shift", "local"), window=lambda s: s.shift, far_origin=lambda s: s.local),
    # dual-chunk attention: far queries at C against keys at n mod s (s = C - local window)
    ExtensionMethod("dual_chunk", ("chunk_size", "local_window"), window=lambda s: s.chunk_size + 1,
                    far_origin=lambda s: s.chunk_size, chunk_length=lambda s: s.chunk_size - s.local_window),
)}


def method_of(settings: ExtensionSettings) -> ExtensionMethod:
    return METHODS[settings.method]


def inv_freq(settings: ExtensionSettings, rotary: CheckpointRotary) -> torch.Tensor:
    """The frequency table a request rotates with on this checkpoint, ``[d/2]`` float64."""
    method = method_of(settings)
    own = method.frequencies(settings, rotary.head_dim, rotary.base)
    if rotary.kind == "default":  # θ_ckpt is θ_plain: the method's own table, without a round trip
        return own
    return rotary.frequencies * (own / rope_inv_freq(rotary.head_dim, rotary.base))
