"""What ``auto`` runs for a request: the one place of the rule, chosen from the evaluation.

For a request occupying ``P`` positions (``settings.positions_used``) on a model trained at
``L`` tokens:

- ``P <= L``: plain RoPE, the model as trained.
- ``P > L``: Self-Extend with the neighbour window ``L / 2`` and the smallest group ``g`` (a
  power of two) that keeps every far position inside training, ``⌊(P - 1)/g⌋ + w - ⌊w/g⌋ < L``;
  without log-n.

bench/evaluate.py's search chose it (bench/README.md, "The search for auto"; SmolLM2 at
L = 8k): at 16k and 32k Self-Extend had a lower loss than ReRoPE and Leaky ReRoPE at any window,
with or without log-n; log-n raised Self-Extend's loss; at a given length the smallest group
that keeps the far positions inside training scored best, and a group one smaller (far
positions past training) collapsed; the window of L/2 scored lower than 3L/4 at the same reach.
"""

from __future__ import annotations

from typing import Any

from rope_plugins.settings import SELF_EXTEND_GROUPS

WINDOW_SHARE = 2  # the neighbour window is L / 2


def smallest_group(positions: int, train_length: int, window: int) -> int:
    """The smallest Self-Extend group keeping the far query of the last position inside
    training; the largest group there is when none does (a request over ~33 L)."""
    for group in SELF_EXTEND_GROUPS:
        if (positions - 1) // group + window - window // group < train_length:
            return group
    return SELF_EXTEND_GROUPS[-1]


def auto_settings(positions: int, train_length: int, window: int | None = None) -> dict[str, Any]:
    """The settings ``auto`` applies to a request spanning ``positions`` at ``train_length``;
    ``window``: the request's own (the group is sized to the window applied)."""
    if positions <= train_length:
        return {"method": "none"}
    window = window or max(1, train_length // WINDOW_SHARE)
    return {"method": "self_extend", "window": window, "group": smallest_group(positions, train_length, window)}
