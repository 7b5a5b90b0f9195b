"""The checkpoint's own rotary (rope_plugins/rules/checkpoint.py) against transformers' rope
initialisation, the oracle's transcriptions and hand calculations; and every method applied
on top of a scaled table."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

from rope_plugins.rules.checkpoint import CheckpointRotary, UnsupportedCheckpoint, checkpoint_rotary
from rope_plugins.rules.methods import METHODS, inv_freq
from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.testing.reference import oracle_checkpoint, oracle_frequencies
from rope_plugins.worker.row_tables import row_values

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
DEFAULT = {"rope_type": "default", "rope_theta": 100000.0}
KINDS = {"default": DEFAULT, "linear": LINEAR, "llama3": LLAMA3, "yarn": YARN}


def llama_config(rope: dict, head_dim: int = 128, max_positions: int = 131072) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_parameters=dict(rope))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_table_is_transformers_own(kind, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = llama_config(KINDS[kind], head_dim)
    init = ROPE_INIT_FUNCTIONS[kind] if kind != "default" else None
    if init is None:
        theirs, factor = 1.0 / (KINDS[kind]["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0
    else:
        theirs, factor = init(config, "cpu")
    ours = checkpoint_rotary(config)
    assert ours.kind == kind and ours.head_dim == head_dim
    torch.testing.assert_close(ours.frequencies, theirs.double(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)
    oracle_table, oracle_factor = oracle_checkpoint(KINDS[kind], head_dim, KINDS[kind]["rope_theta"])
    torch.testing.assert_close(ours.frequencies, oracle_table, rtol=1e-12, atol=0)
    assert ours.attention_factor == pytest.approx(oracle_factor, rel=1e-12)


def test_a_yarn_with_mscale_has_transformers_attention_factor():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = llama_config({**YARN, "mscale": 0.707, "mscale_all_dim": 0.9})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = checkpoint_rotary(config)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12) and ours.attention_factor != 1.0
    torch.testing.assert_close(ours.frequencies, theirs.double(), rtol=1e-6, atol=0)


def test_llama3_by_hand():
    # d = 8, b = 10000: θ = 1, 0.1, 0.01, 0.001, wavelengths 2π/θ = 6.28, 62.8, 628, 6283; L = 1024,
    # low 1, high 4: kept below 1024/4 = 256, divided by 8 above 1024, pair 2 blended with
    # s = (1024 / 628.3 - 1) / 3
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    share = (1024 / (2 * math.pi / 0.01) - 1) / 3
    expected = [1.0, 0.1, (1 - share) * 0.01 / 8 + share * 0.01, 0.001 / 8]
    got = checkpoint_rotary(llama_config(rope, head_dim=8))
    torch.testing.assert_close(got.frequencies, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_training_lengths():
    """yarn is applied past its original length; llama3 and linear were trained with their table."""
    assert checkpoint_rotary(llama_config(YARN, max_positions=131072)).train_length == 32768
    assert checkpoint_rotary(llama_config(LLAMA3, max_positions=131072)).train_length == 131072
    assert checkpoint_rotary(llama_config(DEFAULT, max_positions=4096)).train_length == 4096


def test_gemma3_extends_its_global_layers_table():
    config = Gemma3TextConfig(head_dim=256)
    rotary = checkpoint_rotary(config)
    assert rotary.base == config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    local = checkpoint_rotary(config, "sliding_attention")
    assert local.base == 1e4


def test_an_older_config_with_rope_scaling_reads_the_same():
    config = Qwen2Config(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=dict(YARN))
    legacy = type("Legacy", (), {"head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 1e6,
                                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}})()
    assert checkpoint_rotary(legacy) == checkpoint_rotary(config)


@pytest.mark.parametrize("rope,reason", [
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial rotation")])
def test_what_is_not_served_is_refused_with_the_reason(rope, reason):
    config = type("Config", (), {"head_dim": 64, "max_position_embeddings": 4096, "rope_parameters": rope})()
    with pytest.raises(UnsupportedCheckpoint, match=reason):
        checkpoint_rotary(config)


def test_an_architecture_not_served_is_refused_by_name(tmp_path):
    from transformers import Gemma2Config

    from rope_plugins.frontend.engine_args import engine_kwargs

    Gemma2Config(head_dim=64, num_attention_heads=2, hidden_size=128, architectures=["Gemma2ForCausalLM"]
                 ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedCheckpoint, match="architecture Gemma2ForCausalLM is not served"):
        engine_kwargs(str(tmp_path), defaults={"method": "rerope"})


def test_methods_on_a_scaled_table_by_hand():
    """A linear-2 checkpoint at d = 8, b = 10000: θ_ckpt = 0.5, 0.05, 0.005, 0.0005. Each method
    multiplies it by what it does to plain RoPE: PI 1/k, NTK-old k^(-i/4), and the window
    methods keep it."""
    rotary = checkpoint_rotary(llama_config(LINEAR, head_dim=8))
    table = [0.5, 0.05, 0.005, 0.0005]
    cases = {"none": table, "rerope": table, "leaky_rerope": table, "pi": [t / 4 for t in table],
             "ntk_old": [t * 4 ** (-i / 4) for i, t in enumerate(table)]}
    for method, expected in cases.items():
        got = inv_freq(ExtensionSettings(method=method, factor=4.0, train_length=4096), rotary)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0, msg=method)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_on_every_table_equals_the_oracle(kind, method):
    rope, head_dim = KINDS[kind], 64
    settings = ExtensionSettings(method=method, factor=3.0, beta=0.4, train_length=8192)
    rotary = checkpoint_rotary(llama_config(rope, head_dim))
    expected = oracle_frequencies(settings, head_dim, rope["rope_theta"], rope)
    torch.testing.assert_close(inv_freq(settings, rotary), expected, rtol=1e-12, atol=0)


def test_a_declared_yarn_scales_the_query_by_its_attention_factor_squared():
    rotary = checkpoint_rotary(llama_config(YARN, 64))
    values = row_values(ExtensionSettings(method="none", train_length=32768), rotary)
    assert values.query_factor == pytest.approx((0.1 * math.log(4.0) + 1) ** 2)
    plain = row_values(ExtensionSettings(method="none", train_length=32768), CheckpointRotary.plain(64, 1e6, 32768))
    assert plain.query_factor == 1.0


# ---- through the engine: a tiny Llama with a Llama 3.1-style table --------------------------

SCALED_METHODS = [{"method": "none"}, {"method": "rerope", "window": 37}, {"method": "leaky_rerope", "window": 40},
                  {"method": "ntk_mixed", "factor": 4.0, "log_n": True}, {"method": "yarn", "factor": 4.0},
                  {"method": "pi", "factor": 2.0}]


def test_every_method_on_a_scaled_checkpoint_matches_the_oracle(llama3, engine_defaults):
    from tests.frontend.test_engine_args import PROMPT_LENGTH, assert_matches_oracle, prompt, run

    engine, reference = llama3
    requests = [(prompt(900 + i, PROMPT_LENGTH - 9 * i), fields) for i, fields in enumerate(SCALED_METHODS)]
    for result, (ids, fields) in zip(run(engine, requests, engine_defaults), requests):
        assert_matches_oracle(result, ids, fields, reference, engine_defaults)


def test_none_on_a_scaled_checkpoint_equals_stock_vllm(tiny_llama3_dir, llama3, engine_defaults):
    """Stock vLLM rotates with its own llama3 table: the plugin's reading of it must agree."""
    from tests.conftest import stock_engine
    from tests.frontend.test_engine_args import assert_none_equals_stock, prompt

    with stock_engine(tiny_llama3_dir) as stock:
        requests = [(prompt(950 + i, 180 + 13 * i), {"method": "none"}) for i in range(3)]
        assert_none_equals_stock(llama3[0], stock, requests, engine_defaults, "llama3")
