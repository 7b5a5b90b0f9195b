"""The one function that resolves a request's settings at the edge (server/extension.py): both
meanings of ``auto``, the request's own fields over the server's, every bound named by its
field; and the engine's default, which never carries ``auto``. Pure: no engine."""

from __future__ import annotations

import pytest

from rope_plugins.rules.settings import ExtensionSettings, SettingsError
from rope_plugins.server.config import parse_config
from rope_plugins.server.extension import ServerDefaults, engine_default_fields, resolve_extension
from rope_plugins.server.schemas import ContextExtension

TRAIN = 8192


def defaults(*flags: str) -> ServerDefaults:
    config = parse_config(["--max-model-len", "32768", *flags], environ={})
    engine_default = ExtensionSettings.model_validate({**engine_default_fields(config), "train_length": TRAIN})
    return ServerDefaults.of(config, engine_default)


def resolve(fields: dict | None, positions: int, *flags: str) -> ExtensionSettings:
    requested = None if fields is None else ContextExtension.model_validate(fields)
    return resolve_extension(requested, defaults(*flags), positions)


def test_auto_method_is_plain_rope_inside_training_and_the_rule_beyond():
    assert resolve(None, TRAIN).canonical() == {"method": "none"}
    past = resolve(None, TRAIN + 1)
    assert (past.method, past.window, past.log_n) == ("leaky_rerope", TRAIN // 2, True)
    assert resolve(None, 2 * TRAIN + 1).method == "rerope"


def test_the_requests_own_fields_stay_under_auto():
    own = resolve({"window": 100, "log_n": False}, TRAIN + 1)
    assert (own.method, own.window, own.log_n) == ("leaky_rerope", 100, False)
    # a pretend training length moves the bands with it
    assert resolve({"method": "auto", "train_length": 64}, 100).window == 32


def test_auto_method_past_training_can_be_one_method_at_its_defaults():
    assert resolve(None, TRAIN, "--auto-method", "yarn").method == "none"
    chosen = resolve(None, TRAIN + 1, "--auto-method", "yarn")
    assert (chosen.method, chosen.log_n) == ("yarn", True)
    assert resolve(None, TRAIN + 1, "--auto-method", "yarn", "--no-auto-log-n").log_n is False


def test_auto_factor_is_sized_to_the_positions_at_the_requests_training_length():
    assert resolve({"method": "yarn", "factor": "auto"}, 4000).factor == 1.0
    assert resolve({"method": "yarn", "factor": "auto"}, 16384).factor == 2.0
    assert resolve({"method": "yarn", "factor": "auto", "train_length": 4096}, 16384).factor == 4.0
    assert resolve({"method": "pi", "factor": 3.0}, 16384).factor == 3.0  # a number stays
    assert resolve({"method": "pi"}, 16384, "--factor", "auto").factor == 2.0  # the server's default too


@pytest.mark.parametrize("fields, field", [
    ({"method": "yarn", "factor": "auto", "train_length": 0}, "train_length"),  # not a division by zero
    ({"method": "auto", "train_length": "long"}, "train_length"),
    ({"method": "rerope", "train_length": 40000}, "train_length"),  # past what is served
    ({"method": "rerope", "window": TRAIN}, "window"),
    ({"method": "pi", "factor": "AUTO"}, "factor"),
    ({"method": "warp_drive"}, "method"),
    ({"method": "rerope", "log_n": 1}, "log_n"),
])
def test_every_bound_is_refused_naming_its_field(fields, field):
    with pytest.raises(SettingsError) as refused:
        resolve(fields, 100)
    assert refused.value.field == field


def test_a_training_length_up_to_the_served_context_is_allowed():
    assert resolve({"method": "rerope", "train_length": 32768}, 100).train_length == 32768


@pytest.mark.parametrize("flags, method", [
    ([], "rerope"),  # auto: the engine still serves past training
    (["--auto-method", "yarn"], "yarn"),
    (["--method", "none"], "rerope"),
    (["--method", "none", "--log-n"], "none"),
    (["--method", "pi", "--factor", "auto"], "pi"),
])
def test_the_engine_default_never_carries_auto(flags, method):
    fields = engine_default_fields(parse_config(flags, environ={}))
    assert fields["method"] == method and fields.get("factor") != "auto"
