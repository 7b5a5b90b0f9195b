"""``auto``'s rule (server/auto.py): its bands, and that each is what the committed evaluation
measured best (bench/results/eval.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_plugins.server.auto import auto_settings

EVAL = Path(__file__).resolve().parents[2] / "bench" / "results" / "eval.json"


def test_within_training_it_is_plain_rope():
    assert auto_settings(1, 8192) == auto_settings(8192, 8192) == {"method": "none"}


def test_past_training_each_band_has_its_settings_with_windows_sized_to_the_training_length():
    assert auto_settings(8193, 8192) == {"method": "leaky_rerope", "window": 4096, "log_n": True}
    assert auto_settings(16384, 8192) == auto_settings(8193, 8192)
    assert auto_settings(16385, 8192) == {"method": "rerope", "window": 2048, "log_n": True}
    assert auto_settings(10**6, 8192) == auto_settings(16385, 8192)
    assert auto_settings(100, 64) == {"method": "leaky_rerope", "window": 32, "log_n": True}


def label(settings: dict) -> str:
    extra = ",".join(f"{name}={value}" for name, value in settings.items() if name != "method")
    return settings["method"] + (f"({extra})" if extra else "")


def short_label(settings: dict, train_length: int) -> str:
    """The label the evaluation gives a setting: a method's default window (L/4) is left out."""
    shown = {name: value for name, value in settings.items()
             if not (name == "window" and value == train_length // 4)}
    return label(shown)


@pytest.mark.parametrize("length", [16384, 32768])
def test_its_choice_is_the_lowest_loss_that_found_every_passkey(length):
    """Among the settings measured at this length with every passkey found (the main grid and
    the search), auto's choice for a request of that many positions has the lowest loss; and
    auto's own row is that setting's."""
    rows = {(row["label"], row["length"]): row for row in json.loads(EVAL.read_text())["rows"]}
    found_all = {name: row["nll"] for (name, n), row in rows.items()
                 if n == length and name != "auto" and row.get("nll") is not None
                 and row["passkey_trials"] and row["passkey_found"] == row["passkey_trials"]}
    chosen = short_label(auto_settings(length, 8192), 8192)
    assert chosen in found_all, f"{chosen} did not find every passkey at {length}: {sorted(found_all)}"
    assert found_all[chosen] == min(found_all.values()), sorted(found_all.items(), key=lambda item: item[1])[:3]
    # to float32 noise: the setting's own row may come from another run (another machine, session)
    assert rows[("auto", length)]["nll"] == pytest.approx(found_all[chosen], abs=1e-5)
