"""The settings object: defaults, merging, validation that names the field, canonical hash."""

import pytest
from pydantic import ValidationError

from rope_plugins.rules.settings import ExtensionSettings, SettingsError, parse_settings

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
        # the upper bounds: every number a request may send is bounded
        ({"factor": 2048}, "factor", "less than or equal to 1024"),
        ({"leaky_k": 1e6}, "leaky_k", "less than or equal to 65536"),
        ({"train_length": (1 << 24) + 1}, "train_length", "less than or equal to 16777216"),
        ({"group": 128}, "group", "less than or equal to 64"),
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
    same = ExtensionSettings(method="none", factor=8, window=100, train_length=4096)
    assert plain.canonical_hash() == same.canonical_hash()
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
    with pytest.raises(ValidationError):
        DEFAULTS.window = 5


def test_length_factor_is_one_inside_training_and_the_ratio_past_it():
    from rope_plugins.rules.settings import length_factor

    assert length_factor(100, 8192) == 1.0 and length_factor(8192, 8192) == 1.0
    assert length_factor(20000, 8192) == 20000 / 8192


def test_a_request_occupies_its_prompt_and_all_but_its_last_generated_token():
    from rope_plugins.rules.settings import length_factor, positions_used

    assert positions_used(8191, 1) == 8191 and positions_used(8191, 2) == 8192 and positions_used(10, 0) == 10
    # a whole-training-length prompt scored with one sampled token (echo) stays plain RoPE
    assert length_factor(positions_used(8192, 1), 8192) == 1.0
    assert length_factor(positions_used(8192, 2), 8192) == 8193 / 8192


def test_a_factor_that_is_neither_a_number_nor_auto_names_both():
    with pytest.raises(SettingsError) as error:
        parse_settings({"method": "pi", "factor": "AUTO"}, DEFAULTS)
    assert error.value.field == "factor" and "'auto'" in error.value.reason


@pytest.mark.parametrize("group", [0, 3, 12, 128, 2.0, True, "8"])
def test_self_extend_group_is_a_power_of_two_up_to_64(group):
    with pytest.raises(SettingsError) as error:
        parse_settings({"method": "self_extend", "group": group}, DEFAULTS)
    assert error.value.field == "group"


def test_self_extend_hash_covers_window_and_group_only():
    base = parse_settings({"method": "self_extend", "group": 4}, DEFAULTS)
    assert base.canonical() == {"method": "self_extend", "window": 2048, "group": 4}
    assert base.canonical_hash() != parse_settings({"method": "self_extend", "group": 8}, DEFAULTS).canonical_hash()
    assert base.canonical_hash() == parse_settings({"method": "self_extend", "group": 4, "leaky_k": 3.0},
                                                   DEFAULTS).canonical_hash()


def test_string_defaults_follow_what_they_derive_from():
    """S a third of the training length, W 128 or at most half of S; each recomputed when what
    it derives from is given and it is not."""
    assert (DEFAULTS.shift, DEFAULTS.local) == (2730, 128)
    shorter = parse_settings({"train_length": 300}, DEFAULTS)
    assert (shorter.shift, shorter.local) == (100, 50)
    assert parse_settings({"shift": 100}, DEFAULTS).local == 50
    assert parse_settings({"shift": 100, "local": 7}, DEFAULTS).local == 7
    assert parse_settings({"train_length": 4096, "local": 0}, DEFAULTS).shift == 1365


@pytest.mark.parametrize("fields,field,words", [
    ({"shift": 8192}, "shift", "smaller than train_length (8192)"),
    ({"shift": 0}, "shift", "greater than 0"),
    ({"local": 2730}, "local", "smaller than shift (2730)"),
    ({"shift": 100, "local": 100}, "local", "smaller than shift (100)"),
    ({"train_length": 300, "local": 100}, "local", "smaller than shift (100)"),
    ({"local": -1}, "local", "greater than or equal to 0"),
    ({"shift": 1.5}, "shift", "valid integer"),
])
def test_bad_string_fields_name_themselves(fields, field, words):
    with pytest.raises(SettingsError) as error:
        parse_settings({"method": "string", **fields}, DEFAULTS)
    assert error.value.field == field and words in error.value.reason


def test_string_hash_covers_shift_and_local_only():
    base = parse_settings({"method": "string", "shift": 1000}, DEFAULTS)
    assert base.canonical() == {"method": "string", "shift": 1000, "local": 128}
    assert base.canonical_hash() != parse_settings({"method": "string", "shift": 1000, "local": 64},
                                                   DEFAULTS).canonical_hash()
    assert base.canonical_hash() == parse_settings({"method": "string", "shift": 1000, "window": 77},
                                                   DEFAULTS).canonical_hash()


def test_dual_chunk_defaults_are_chunkllamas_and_follow_what_they_derive_from():
    """ChunkLlama's chunk size 3L/4 and local window L/16 (chunks of 5632 at 8192), the chunk
    size cut so that its chunks are whole 64s; each recomputed when what it derives from is given."""
    assert (DEFAULTS.chunk_size, DEFAULTS.local_window) == (6144, 512)
    shorter = parse_settings({"method": "dual_chunk", "train_length": 1000}, DEFAULTS)
    assert (shorter.chunk_size, shorter.local_window) == (62 + 640, 62)  # 750 - 62 = 688 cut to 640
    assert parse_settings({"method": "dual_chunk", "local_window": 100}, DEFAULTS).chunk_size == 100 + 6016
    qwen_1m = parse_settings({"method": "dual_chunk", "train_length": 262144, "chunk_size": 262144,
                              "local_window": 8192}, DEFAULTS)  # Qwen2.5-7B-Instruct-1M's config
    assert qwen_1m.chunk_size - qwen_1m.local_window == 253952


@pytest.mark.parametrize("fields,field,words", [
    ({"chunk_size": 1000}, "chunk_size", "must exceed local_window"),
    ({"chunk_size": 6145}, "chunk_size", "multiple of 64"),
    ({"chunk_size": 8256, "local_window": 64}, "chunk_size", "at most train_length (8192)"),
    ({"chunk_size": 0}, "chunk_size", "greater than 0"),
    ({"local_window": -1}, "local_window", "greater than or equal to 0"),
    ({"local_window": 4000, "chunk_size": 8000}, "chunk_size", "must exceed local_window"),
    ({"train_length": 64}, "chunk_size", "at most train_length (64)"),  # defaults that cannot fit
])
def test_bad_dual_chunk_fields_name_themselves(fields, field, words):
    with pytest.raises(SettingsError) as error:
        parse_settings({"method": "dual_chunk", **fields}, DEFAULTS)
    assert error.value.field == field and words in error.value.reason


def test_dual_chunk_fields_are_checked_for_dual_chunk_alone():
    """Defaults that could not chunk (a training length of 64) are no error for other methods."""
    assert parse_settings({"method": "rerope", "train_length": 64}, DEFAULTS).chunk_size == 68


def test_dual_chunk_hash_covers_chunk_size_and_local_window_only():
    base = parse_settings({"method": "dual_chunk"}, DEFAULTS)
    assert base.canonical() == {"method": "dual_chunk", "chunk_size": 6144, "local_window": 512}
    assert base.canonical_hash() != parse_settings({"method": "dual_chunk", "chunk_size": 6208},
                                                   DEFAULTS).canonical_hash()
    assert base.canonical_hash() == parse_settings({"method": "dual_chunk", "shift": 77}, DEFAULTS).canonical_hash()
