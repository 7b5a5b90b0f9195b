"""The settings object: defaults, merging, validation that names the field, canonical hash."""

import pytest

from rope_plugins.settings import ExtensionSettings, SettingsError, parse_settings

DEFAULTS = ExtensionSettings(method="rerope", train_length=8192)


def test_defaults_and_derived_window():
    assert DEFAULTS.window == 2048
    assert parse_settings({"train_length": 4096}, DEFAULTS).window == 1024
    assert parse_settings(None, DEFAULTS) is DEFAULTS
    merged = parse_settings({"method": "leaky_rerope", "leaky_k": 32, "log_n": True}, DEFAULTS)
    assert (merged.method, merged.window, merged.leaky_k, merged.log_n) == ("leaky_rerope", 2048, 32.0, True)


@pytest.mark.parametrize(
    "fields,field,words",
    [
        ({"method": "rerope2"}, "method", "unknown method 'rerope2'"),
        ({"factor": 0.5}, "factor", "greater than or equal to 1"),
        ({"window": 0}, "window", "greater than 0"),
        ({"window": 8192}, "window", "smaller than train_length (8192)"),
        ({"window": 5000, "train_length": 4096}, "window", "smaller than train_length (4096)"),
        ({"leaky_k": 0.5}, "leaky_k", "greater than or equal to 1"),
        ({"beta": 1.5}, "beta", "less than or equal to 1"),
        ({"beta": "high"}, "beta", "valid number"),
        ({"log_n": "yes"}, "log_n", "valid boolean"),
        ({"train_length": 1}, "train_length", "greater than 1"),
        ({"window": 2.5}, "window", "valid integer"),
        ({"temperature": 2}, "temperature", "unknown field"),
    ],
)
def test_bad_field_is_named_with_reason(fields, field, words):
    with pytest.raises(SettingsError) as caught:
        parse_settings(fields, DEFAULTS)
    assert caught.value.field == field
    assert words in caught.value.reason
    assert str(caught.value).startswith(f"context_extension.{field}: ")


def test_not_an_object():
    with pytest.raises(SettingsError, match="must be an object"):
        parse_settings(["rerope"], DEFAULTS)


def test_canonical_hash_ignores_fields_the_method_does_not_use():
    plain = ExtensionSettings(method="none", train_length=8192)
    assert plain.canonical() == {"method": "none"}
    assert plain.canonical_hash() == ExtensionSettings(method="none", factor=8, window=100, train_length=4096).canonical_hash()
    rerope = parse_settings({"window": 1024, "factor": 2}, DEFAULTS)
    assert rerope.canonical_hash() == parse_settings({"window": 1024, "factor": 32}, DEFAULTS).canonical_hash()


@pytest.mark.parametrize(
    "a,b",
    [
        ({"method": "rerope", "window": 1024}, {"method": "rerope", "window": 1025}),
        ({"method": "rerope"}, {"method": "leaky_rerope"}),
        ({"method": "leaky_rerope", "leaky_k": 8}, {"method": "leaky_rerope", "leaky_k": 16}),
        ({"method": "ntk_mixed", "beta": 0.5}, {"method": "ntk_mixed", "beta": 0.625}),
        ({"method": "pi", "factor": 2}, {"method": "pi", "factor": 4}),
        ({"method": "none"}, {"method": "none", "log_n": True}),
        ({"method": "none", "log_n": True}, {"method": "none", "log_n": True, "train_length": 4096}),
        ({"method": "yarn"}, {"method": "yarn", "train_length": 4096}),
    ],
)
def test_canonical_hash_separates_different_computations(a, b):
    assert parse_settings(a, DEFAULTS).canonical_hash() != parse_settings(b, DEFAULTS).canonical_hash()


def test_settings_are_immutable():
    with pytest.raises(Exception):
        DEFAULTS.window = 5
