"""What ``auto`` runs for a request: the one place of the rule, chosen from the evaluation.

A request occupying ``P`` positions (``settings.positions_used``) on a model trained at ``L``
tokens runs the settings of the first band of :data:`BANDS` that reaches ``P``: plain RoPE
within training; past it, of the settings `python -m bench quality` measured at the band's longest
length (bench/README.md, "The search for auto"; SmolLM2 at L = 8k, 16k and 32k), the one with
the lowest loss among those that found every passkey.

Lower losses were measured, but not with every passkey found: Self-Extend (window L/2 or 3L/4,
the smallest group keeping far positions inside training) scored below plain RoPE's own loss at
8k at both lengths and found 2 of 6 passkeys at each. A request that only scores or continues
text may ask for it (``{"method": "self_extend", "window": ..., "group": ...}``).
"""

from __future__ import annotations

import math
from typing import Any

# (the longest request of the band as a multiple of L, its settings; a window as a share of L)
BANDS: tuple[tuple[float, dict[str, Any]], ...] = (
    (1.0, {"method": "none"}),
    (2.0, {"method": "leaky_rerope", "window": 1 / 2, "log_n": True}),
    (math.inf, {"method": "rerope", "window": 1 / 4, "log_n": True}),
)


def auto_settings(positions: int, train_length: int) -> dict[str, Any]:
    """The settings ``auto`` applies to a request spanning ``positions`` at ``train_length``."""
    chosen = dict(next(settings for reach, settings in BANDS if positions <= reach * train_length))
    if "window" in chosen:
        chosen["window"] = max(1, int(train_length * chosen["window"]))
    return chosen
