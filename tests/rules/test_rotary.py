"""The rotary formulas and the methods table (rope_plugins/rules/rotary.py, rope_plugins/rules/methods.py)
against hand calculations, the seeds' identities, transformers' own rope initialisation and
the oracle's independent transcriptions."""

import math

import pytest
import torch

from rope_plugins.rules.checkpoint import CheckpointRotary
from rope_plugins.rules.methods import METHODS, inv_freq
from rope_plugins.rules.rotary import (
    log_n_scale,
    ntk_fixed_inv_freq,
    ntk_mixed_inv_freq,
    pi_inv_freq,
    rope_inv_freq,
    rotate,
    yarn_attention_factor,
    yarn_inv_freq,
)
from rope_plugins.rules.settings import ExtensionSettings
from rope_plugins.testing.reference import oracle_frequencies
from rope_plugins.worker.row_tables import row_values

# d = 8, b = 10000, k = 4: theta_i = 10000^(-i/4) = 1, 0.1, 0.01, 0.001 (worked by hand).
D, BASE, K = 8, 10000.0, 4.0
HAND = {
    "none": [1.0, 0.1, 0.01, 0.001],
    "pi": [0.25, 0.025, 0.0025, 0.00025],
    # (b k)^(-i/4) = 40000^(-i/4)
    "ntk_old": [1.0, 1 / 40000**0.25, 1 / 40000**0.5, 1 / 40000**0.75],
    # b^(-i/4) k^(-(i+1)/4): 4^-0.25, 0.1 * 4^-0.5, 0.01 * 4^-0.75, 0.001 / 4
    "ntk_fixed": [4**-0.25, 0.05, 0.01 * 4**-0.75, 0.00025],
    # beta = 0.5: a = ln 4 / sqrt(4) = ln 2, exp(-ln2 sqrt(i+1)) = 2^-sqrt(i+1)
    "ntk_mixed": [2**-1.0, 0.1 * 2 ** -math.sqrt(2), 0.01 * 2 ** -math.sqrt(3), 0.001 * 2**-2.0],
}


@pytest.mark.parametrize("method", sorted(HAND))
def test_frequencies_match_hand_calculation(method):
    settings = ExtensionSettings(method=method, factor=K, beta=0.5, train_length=512)
    got = inv_freq(settings, CheckpointRotary.plain(D, BASE, 4096))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(HAND[method], dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope"])
def test_relative_methods_keep_plain_frequencies(method):
    settings = ExtensionSettings(method=method, factor=K, train_length=512)
    torch.testing.assert_close(inv_freq(settings, CheckpointRotary.plain(D, BASE, 4096)),
                               torch.tensor(HAND["none"], dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("head_dim,base,factor,beta,train_length", [
    (64, 100000.0, 4.0, 0.625, 8192), (128, 500000.0, 16.0, 0.3, 4096), (8, 10000.0, 2.5, 0.9, 256)])
def test_the_table_equals_the_oracle_transcriptions(method, head_dim, base, factor, beta, train_length):
    settings = ExtensionSettings(method=method, factor=factor, beta=beta, train_length=train_length)
    torch.testing.assert_close(inv_freq(settings, CheckpointRotary.plain(head_dim, base, 4096)),
                               oracle_frequencies(settings, head_dim, base), rtol=1e-12, atol=0)


def transformers_rope(rope_type: str, head_dim: int, base: float, **parameters) -> tuple[torch.Tensor, float]:
    """transformers' own frequencies (float32) and attention factor for one rope type."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, head_dim=head_dim,
                         max_position_embeddings=round(parameters.get("original_max_position_embeddings", 2048)
                                                       * parameters["factor"]),
                         rope_parameters={"rope_type": rope_type, "rope_theta": base, **parameters})
    frequencies, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return frequencies.double(), float(attention_factor)


@pytest.mark.parametrize("head_dim,base,factor,train_length", [(128, 10000.0, 8.0, 4096), (64, 100000.0, 3.0, 8192),
                                                               (16, 10000.0, 4.0, 64)])
def test_pi_and_yarn_rows_equal_transformers(head_dim, base, factor, train_length):
    """Through the table and the worker's row values (so YaRN's train_length is the
    setting's): frequencies to float32 precision, YaRN's query factor = the square of
    transformers' attention factor (which it puts on q and k alike)."""
    pi = ExtensionSettings(method="pi", factor=factor, train_length=train_length)
    theirs, _ = transformers_rope("linear", head_dim, base, factor=factor)
    torch.testing.assert_close(row_values(pi, CheckpointRotary.plain(head_dim, base, 4096)).theta, theirs,
                               rtol=1e-6, atol=0)
    yarn = ExtensionSettings(method="yarn", factor=factor, train_length=train_length)
    theirs, attention_factor = transformers_rope("yarn", head_dim, base, factor=factor,
                                                 original_max_position_embeddings=train_length)
    ours = row_values(yarn, CheckpointRotary.plain(head_dim, base, 4096))
    torch.testing.assert_close(ours.theta, theirs, rtol=1e-6, atol=0)
    assert ours.query_factor == pytest.approx(attention_factor**2, rel=1e-12)


@pytest.mark.parametrize("head_dim,base,factor", [(64, 100000.0, 4.0), (128, 10000.0, 16.0), (8, 500000.0, 2.5)])
def test_ntk_mixed_identities_of_the_seed(head_dim, base, factor):
    # beta = 1 is ntk_fixed, beta = 0 is position interpolation
    torch.testing.assert_close(ntk_mixed_inv_freq(head_dim, base, factor, 1.0),
                               ntk_fixed_inv_freq(head_dim, base, factor), rtol=1e-12, atol=0)
    torch.testing.assert_close(ntk_mixed_inv_freq(head_dim, base, factor, 0.0), pi_inv_freq(head_dim, base, factor),
                               rtol=1e-12, atol=0)
    # every beta extends the lowest frequency by exactly k (lambda_1 ... lambda_{d/2} = k)
    for beta in (0.25, 0.625, 0.9):
        ratio = rope_inv_freq(head_dim, base)[-1] / ntk_mixed_inv_freq(head_dim, base, factor, beta)[-1]
        assert float(ratio) == pytest.approx(factor, rel=1e-12)


def test_ntk_mixed_radices_are_non_increasing():
    # lambda_m = theta_plain / theta_mixed ratios of successive pairs: low bits carry more
    plain, mixed = rope_inv_freq(64, 1e5), ntk_mixed_inv_freq(64, 1e5, 8.0, 0.625)
    cumulative = plain / mixed  # lambda_1 ... lambda_{i+1}
    radices = torch.cat((cumulative[:1], cumulative[1:] / cumulative[:-1]))
    assert bool((radices[1:] <= radices[:-1] + 1e-12).all()) and bool((radices >= 1).all())


def test_yarn_by_hand():
    # d = 128, b = 10000, L_train = 4096: ramp from floor(128 ln(4096/(32 2pi)) / (2 ln 1e4)) = 20
    # to ceil(128 ln(4096/(2pi)) / (2 ln 1e4)) = 46; pair 33 is halfway.
    theta = rope_inv_freq(128, 10000.0)
    yarn = yarn_inv_freq(128, 10000.0, 8.0, 4096)
    assert torch.equal(yarn[:21], theta[:21])
    torch.testing.assert_close(yarn[46:], theta[46:] / 8, rtol=1e-12, atol=0)
    assert float(yarn[33]) == pytest.approx(float(theta[33]) * (0.5 + 0.5 / 8), rel=1e-12)
    assert yarn_attention_factor(8.0) == pytest.approx(0.1 * math.log(8) + 1)
    assert yarn_attention_factor(1.0) == 1.0


@pytest.mark.parametrize("fields,window,leak", [
    ({"method": "rerope", "window": 5}, 5, 0.0), ({"method": "leaky_rerope", "window": 7, "leaky_k": 4.0}, 7, 0.25),
    *[({"method": method}, 0, 1.0) for method in ("none", "pi", "ntk_old", "ntk_fixed", "ntk_mixed", "yarn")]])
def test_position_rules(fields, window, leak):
    """Near window w and leak ρ: ReRoPE clips at w (ρ = 0), Leaky ReRoPE leaks 1/k, the
    frequency methods have no window and keep every position (ρ = 1)."""
    values = row_values(ExtensionSettings(train_length=64, **fields), CheckpointRotary.plain(8, BASE, 4096))
    assert (values.window, values.leak) == (window, leak)


def test_the_canonical_form_holds_exactly_the_fields_a_method_uses():
    for name, method in METHODS.items():
        settings = ExtensionSettings(method=name, train_length=512)
        assert list(settings.canonical()) == ["method", *method.fields]


def test_log_n_factor():
    positions = torch.tensor([0, 10, 511, 512, 1023, 4095])
    got = log_n_scale(positions, 512)
    expected = [1, 1, 1, math.log(513) / math.log(512), math.log(1024) / math.log(512), 12 / 9]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    yarn = row_values(ExtensionSettings(method="yarn", factor=4.0, log_n=True, train_length=512),
                      CheckpointRotary.plain(8, BASE, 4096))
    assert yarn.query_factor == pytest.approx((0.1 * math.log(4) + 1) ** 2) and yarn.log_n_length == 512


@pytest.mark.parametrize("neox_style", [True, False])
def test_rotate_is_complex_multiplication(neox_style):
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=torch.float64)
    angle = torch.randn(5, 4, dtype=torch.float64)
    if neox_style:
        real, imag = x[:, :4], x[:, 4:]
    else:
        real, imag = x[:, 0::2], x[:, 1::2]
    expected = torch.complex(real, imag) * torch.polar(torch.ones_like(angle), angle)
    got = rotate(x, angle, neox_style)
    got_real, got_imag = (got[:, :4], got[:, 4:]) if neox_style else (got[:, 0::2], got[:, 1::2])
    torch.testing.assert_close(got_real, expected.real)
    torch.testing.assert_close(got_imag, expected.imag)


@pytest.mark.parametrize("head_dim,base,train_length,seen", [(64, 100000.0, 8192, 20000), (128, 10000.0, 4096, 4097),
                                                             (16, 10000.0, 64, 300), (16, 10000.0, 64, 50)])
def test_ntk_dynamic_is_transformers_dynamic_rope_at_the_stepped_length(head_dim, base, train_length, seen):
    """The oracle's θ for a query that has seen ``seen`` tokens is transformers' "dynamic" rope
    (factor 1) at that length rounded up to a whole step past training; the planner's form
    (θ k^(-e), rope_plugins.rules.rotary) equals it."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rope_plugins.rules.rotary import dynamic_length, ntk_dynamic_exponent
    from rope_plugins.rules.settings import DYNAMIC_STEP
    from rope_plugins.testing.reference import oracle_query_frequencies

    settings = ExtensionSettings(method="ntk_dynamic", train_length=train_length)
    sized = int(dynamic_length(torch.tensor(seen - 1), train_length, DYNAMIC_STEP))
    assert sized == train_length if seen <= train_length else sized - DYNAMIC_STEP < seen <= sized
    config = LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, head_dim=head_dim,
                         max_position_embeddings=train_length,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": base, "factor": 1.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=sized)
    oracle = oracle_query_frequencies(settings, head_dim, base, torch.tensor([seen - 1]))[0]
    torch.testing.assert_close(oracle, theirs.double(), rtol=1e-6, atol=0)  # theirs is float32
    ours = rope_inv_freq(head_dim, base) * (sized / train_length) ** -ntk_dynamic_exponent(head_dim)
    torch.testing.assert_close(ours, oracle, rtol=1e-12, atol=0)
