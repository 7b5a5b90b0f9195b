"""The worker-side settings tracker under hostile settings: whatever reaches it (the front end
bypassed, or a value that passed validation and still fails), it keeps the engine alive on the
engine defaults, and its per-settings cache stays bounded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from rope_plugins import tracker as tracker_module
from rope_plugins.checkpoint import CheckpointRotary
from rope_plugins.settings import EXTRA_ARGS_KEY, ExtensionSettings
from rope_plugins.tracker import ROW_VALUES_CACHE_SIZE, RequestSettingsTracker, cached_row_values

ROWS, HEAD_DIM, TRAIN_LENGTH = 4, 64, 8192


@pytest.fixture
def tracker():
    hf_config = SimpleNamespace(head_dim=HEAD_DIM, hidden_size=576, num_attention_heads=9, rope_theta=100000.0,
                                max_position_embeddings=TRAIN_LENGTH,
                                rope_extension={"method": "rerope", "train_length": TRAIN_LENGTH})
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                             scheduler_config=SimpleNamespace(max_num_seqs=ROWS))
    return RequestSettingsTracker(config, torch.device("cpu"), False)


def add(tracker, row: int, fields) -> None:
    params = SamplingParams(max_tokens=1, extra_args={EXTRA_ARGS_KEY: fields})
    tracker.update_state(BatchUpdate(batch_size=row + 1, removed=[], added=[(row, params, None, [])], moved=[]))


@pytest.mark.parametrize("fields", [
    {"method": "rerope", "train_length": 2**64 - 1, "window": 2**63},  # the request that killed the engine
    {"method": "leaky_rerope", "leaky_k": float("inf")},
    {"method": "ntk_mixed", "factor": float("nan")},
    {"method": "warp_drive"},
    "not an object",
])
def test_settings_the_front_end_would_refuse_fall_back_to_the_defaults(tracker, fields):
    add(tracker, 1, fields)
    assert tracker.settings[1] == tracker.defaults
    assert tracker.tables.window[1] == tracker.defaults.window


def test_a_failure_while_building_the_row_falls_back_instead_of_killing_the_engine(tracker, monkeypatch):
    def broken(settings, rotary):
        if settings.method == "yarn":
            raise ValueError("Overflow when unpacking long long")
        return real(settings, rotary)

    real = tracker_module.row_values
    cached_row_values.cache_clear()
    monkeypatch.setattr(tracker_module, "row_values", broken)
    add(tracker, 2, {"method": "yarn", "factor": 3.0})
    assert tracker.settings[2] == tracker.defaults
    add(tracker, 3, {"method": "rerope", "window": 100})
    assert tracker.settings[3].window == 100 and tracker.tables.window[3] == 100
    cached_row_values.cache_clear()


def test_the_per_settings_cache_is_bounded(tracker):
    cached_row_values.cache_clear()
    for window in range(1, ROW_VALUES_CACHE_SIZE + 200):
        add(tracker, 0, {"method": "rerope", "window": window})
    assert cached_row_values.cache_info().currsize == ROW_VALUES_CACHE_SIZE
    assert tracker.tables.window[0] == ROW_VALUES_CACHE_SIZE + 199


def test_bounds_keep_every_accepted_value_inside_the_worker_tables():
    """The largest values validation accepts still fit the int64 / float64 row tables."""
    from rope_plugins.settings import MAX_LEAKY_K, MAX_POSITIONS

    largest = ExtensionSettings(method="leaky_rerope", train_length=MAX_POSITIONS, window=MAX_POSITIONS - 1,
                                leaky_k=MAX_LEAKY_K, log_n=True)
    values = tracker_module.row_values(largest, CheckpointRotary.plain(HEAD_DIM, 100000.0, 4096))
    for value in (values.theta, values.window, values.leak, values.log_n_length, values.query_factor):
        assert torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all()
