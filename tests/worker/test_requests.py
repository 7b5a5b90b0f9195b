"""The worker-side settings tracker under hostile settings: whatever reaches it (the front end
bypassed, or a value that passed validation and still fails), it keeps the engine alive on the
engine defaults, and its per-settings cache stays bounded. The V2 runner's request slots: the
builder's rows gathered in batch order, bad settings refused at admission, and the engine
built with the settings processor of the runner vLLM will run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from rope_plugins.rules.checkpoint import CheckpointRotary
from rope_plugins.rules.settings import EXTRA_ARGS_KEY, ExtensionSettings
from rope_plugins.worker import row_tables as row_tables_module
from rope_plugins.worker.requests import RequestSettingsAdmission, RequestSettingsTracker, RequestSlots, step_tables
from rope_plugins.worker.row_tables import ROW_VALUES_CACHE_SIZE, cached_row_values

ROWS, HEAD_DIM, TRAIN_LENGTH = 4, 64, 8192


def engine_config():
    hf_config = SimpleNamespace(head_dim=HEAD_DIM, hidden_size=576, num_attention_heads=9, rope_theta=100000.0,
                                max_position_embeddings=TRAIN_LENGTH,
                                rope_extension={"method": "rerope", "train_length": TRAIN_LENGTH})
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                           scheduler_config=SimpleNamespace(max_num_seqs=ROWS))


@pytest.fixture
def tracker():
    return RequestSettingsTracker(engine_config(), torch.device("cpu"), False)


def request(fields) -> SamplingParams:
    return SamplingParams(max_tokens=1, extra_args={EXTRA_ARGS_KEY: fields})


def add(tracker, row: int, fields) -> None:
    added = [(row, request(fields), None, [])]
    tracker.update_state(BatchUpdate(batch_size=row + 1, removed=[], added=added, moved=[]))


REFUSED_BY_THE_FRONT_END = [
    {"method": "rerope", "train_length": 2**64 - 1, "window": 2**63},  # the request that killed the engine
    {"method": "leaky_rerope", "leaky_k": float("inf")},
    {"method": "ntk_mixed", "factor": float("nan")},
    {"method": "warp_drive"},
    "not an object",
]


@pytest.mark.parametrize("fields", REFUSED_BY_THE_FRONT_END)
def test_settings_the_front_end_would_refuse_fall_back_to_the_defaults(tracker, fields):
    add(tracker, 1, fields)
    assert tracker.settings[1] == tracker.defaults
    assert tracker.tables.window[1] == tracker.defaults.window


def test_a_failure_while_building_the_row_falls_back_instead_of_killing_the_engine(tracker, monkeypatch):
    def broken(settings, rotary):
        if settings.method == "yarn":
            raise ValueError("Overflow when unpacking long long")
        return real(settings, rotary)

    real = row_tables_module.row_values
    cached_row_values.cache_clear()
    monkeypatch.setattr(row_tables_module, "row_values", broken)
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
    from rope_plugins.rules.settings import MAX_LEAKY_K, MAX_POSITIONS

    largest = ExtensionSettings(method="leaky_rerope", train_length=MAX_POSITIONS, window=MAX_POSITIONS - 1,
                                leaky_k=MAX_LEAKY_K, log_n=True)
    values = row_tables_module.row_values(largest, CheckpointRotary.plain(HEAD_DIM, 100000.0, 4096))
    for value in (values.theta, values.window, values.leak, values.log_n_length, values.query_factor):
        assert torch.isfinite(torch.as_tensor(value, dtype=torch.float64)).all()


def test_the_v1_builder_reads_the_trackers_rows():
    config = engine_config()
    tracker = RequestSettingsTracker(config, torch.device("cpu"), False)
    add(tracker, 0, {"method": "rerope", "window": 100})
    tables = step_tables(config, SimpleNamespace(req_idx=None, num_reqs=1))
    assert tables.window[0] == 100


def test_the_v2_builder_gathers_each_rows_slot_in_batch_order():
    config = engine_config()
    slots = RequestSlots(config)
    slots.add(3, request({"method": "rerope", "window": 100}))
    slots.add(1, request({"method": "yarn", "factor": 4.0, "log_n": True}))
    tables = step_tables(config, SimpleNamespace(req_idx=np.array([3, 1, 0]), num_reqs=3))
    assert tables.window.tolist() == [100, 0, slots.defaults.window]
    assert tables.log_n_length.tolist() == [0.0, TRAIN_LENGTH, 0.0]
    torch.testing.assert_close(tables.theta[1], slots.tables.theta[1])
    tables.window[0] = -1  # the step's copy: the slots stay as written
    assert slots.tables.window[3] == 100
    with pytest.raises(RuntimeError, match="req_idx"):
        step_tables(config, SimpleNamespace(req_idx=None, num_reqs=1))


@pytest.mark.parametrize("fields", REFUSED_BY_THE_FRONT_END)
def test_a_slot_given_settings_the_front_end_would_refuse_takes_the_defaults(fields):
    slots = RequestSlots(engine_config())
    slots.add(2, request(fields))
    assert slots.settings[2] == slots.defaults and slots.tables.window[2] == slots.defaults.window


def test_an_engine_without_the_plugins_settings_is_named():
    with pytest.raises(RuntimeError, match="engine_kwargs"):
        step_tables(engine_config(), SimpleNamespace(req_idx=None, num_reqs=1))


def test_the_v2_admission_refuses_bad_settings_naming_the_field_and_takes_no_request():
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="context_extension.window") as caught:
        RequestSettingsAdmission.validate_params(request({"method": "rerope", "window": -4}))
    assert caught.value.parameter == "context_extension.window"
    RequestSettingsAdmission.validate_params(request({"method": "rerope", "window": 40}))
    admission = RequestSettingsAdmission(engine_config(), None)
    assert admission.add_request(0, request(None)) is False
    logits = torch.zeros(2, 8)
    assert admission.apply(logits, None) is logits


@pytest.mark.parametrize("choice,processor", [("1", RequestSettingsAdmission), ("0", RequestSettingsTracker)])
def test_the_engine_gets_the_settings_processor_of_the_runner_vllm_will_run(tiny_llama_dir, monkeypatch, choice,
                                                                           processor):
    from rope_plugins.frontend.engine_args import engine_kwargs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", choice)
    assert engine_kwargs(str(tiny_llama_dir), defaults={"method": "rerope"})["logits_processors"] == [processor]
