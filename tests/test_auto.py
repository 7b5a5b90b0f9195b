"""``auto``'s rule (server/auto.py): its cases, and that it is what the committed evaluation
measured best (bench/results/eval.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.auto import auto_settings, smallest_group

EVAL = Path(__file__).resolve().parent.parent / "bench" / "results" / "eval.json"


def test_within_training_it_is_plain_rope():
    assert auto_settings(1, 8192) == auto_settings(8192, 8192) == {"method": "none"}


def test_past_training_it_is_self_extend_with_the_smallest_group_that_stays_inside_training():
    assert auto_settings(8193, 8192) == {"method": "self_extend", "window": 4096, "group": 2}
    assert auto_settings(16384, 8192) == {"method": "self_extend", "window": 4096, "group": 4}
    assert auto_settings(32768, 8192) == {"method": "self_extend", "window": 4096, "group": 8}
    # g = 8 reaches ⌊36863/8⌋ + 4096 - 512 = 8191; one position more needs 16
    assert auto_settings(36864, 8192)["group"] == 8 and auto_settings(36865, 8192)["group"] == 16
    for positions in range(65, 64 * 30, 7):  # every length up to ~30 L at L = 64
        chosen = auto_settings(positions, 64)
        group, window = chosen["group"], chosen["window"]
        assert (positions - 1) // group + window - window // group < 64  # the last query's far position
        if group > 1:  # and half the group would not do
            half = group // 2
            assert (positions - 1) // half + window - window // half >= 64
    assert smallest_group(10**7, 64, 32) == 64  # beyond reach: the largest group
    # a request's own window: the group is sized to it (⌊12999/2⌋ + 1000 - 500 < 8192; with the
    # rule's 4096, 6499 + 4096 - 2048 is not)
    assert auto_settings(13000, 8192, 1000) == {"method": "self_extend", "window": 1000, "group": 2}
    assert auto_settings(13000, 8192)["group"] == 4


def measured() -> dict[tuple[str, int], dict]:
    return {(row["label"], row["length"]): row for row in json.loads(EVAL.read_text())["rows"]}


def label(settings: dict) -> str:
    extra = ",".join(f"{name}={value}" for name, value in settings.items() if name != "method")
    return settings["method"] + (f"({extra})" if extra else "")


@pytest.mark.parametrize("length", [16384, 32768])
def test_its_choice_scored_the_lowest_loss_the_evaluation_found_past_training(length):
    """Among every setting measured at this length (the main grid, the ablations and the
    search), auto's choice for a request of that many positions has the lowest loss."""
    rows = measured()
    chosen = label(auto_settings(length, 8192))
    losses = {name: row["nll"] for (name, n), row in rows.items() if n == length and row.get("nll") is not None
              and name != "auto"}
    assert chosen in losses, f"{chosen} was not measured at {length}"
    assert losses[chosen] == min(losses.values()), sorted(losses.items(), key=lambda item: item[1])[:3]
