"""Every method's frequency table against hand calculations and the seeds' identities."""

import math

import pytest
import torch

from rope_plugins.rotary import (
    effective_relative,
    inv_freq,
    leaky_rerope_relative,
    log_n_scale,
    ntk_fixed_inv_freq,
    ntk_mixed_inv_freq,
    pi_inv_freq,
    query_scale,
    rerope_relative,
    rope_inv_freq,
    rotate,
    yarn_attention_factor,
    yarn_inv_freq,
)
from rope_plugins.settings import ExtensionSettings

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
    got = inv_freq(settings, D, BASE)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(HAND[method], rel=1e-12)


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope"])
def test_relative_methods_keep_plain_frequencies(method):
    settings = ExtensionSettings(method=method, factor=K, train_length=512)
    assert inv_freq(settings, D, BASE).tolist() == pytest.approx(HAND["none"], rel=1e-12)


@pytest.mark.parametrize("head_dim,base,factor", [(64, 100000.0, 4.0), (128, 10000.0, 16.0), (8, 500000.0, 2.5)])
def test_ntk_mixed_identities_of_the_seed(head_dim, base, factor):
    # beta = 1 is ntk_fixed, beta = 0 is position interpolation
    assert torch.allclose(ntk_mixed_inv_freq(head_dim, base, factor, 1.0), ntk_fixed_inv_freq(head_dim, base, factor), rtol=1e-12)
    assert torch.allclose(ntk_mixed_inv_freq(head_dim, base, factor, 0.0), pi_inv_freq(head_dim, base, factor), rtol=1e-12)
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
    assert torch.allclose(yarn[46:], theta[46:] / 8, rtol=1e-12)
    assert float(yarn[33]) == pytest.approx(float(theta[33]) * (0.5 + 0.5 / 8), rel=1e-12)
    assert yarn_attention_factor(8.0) == pytest.approx(0.1 * math.log(8) + 1)
    assert yarn_attention_factor(1.0) == 1.0


def test_yarn_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = transformers.LlamaConfig(
        hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
    )
    theirs, attention_factor = _compute_yarn_parameters(config)
    assert torch.allclose(theirs.double(), yarn_inv_freq(128, 10000.0, 8.0, 4096), rtol=1e-6)
    assert attention_factor == pytest.approx(yarn_attention_factor(8.0))


def test_rerope_and_leaky_relative_positions():
    distance = torch.arange(10, dtype=torch.float64)
    assert rerope_relative(distance, 4).tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4]
    assert leaky_rerope_relative(distance, 4, 2.0).tolist() == [0, 1, 2, 3, 4, 4.5, 5, 5.5, 6, 6.5]
    assert torch.equal(leaky_rerope_relative(distance, 4, 1.0), distance)
    settings = ExtensionSettings(method="rerope", window=3, train_length=16)
    assert effective_relative(settings, distance.long()).max() == 3


def test_log_n_factor():
    positions = torch.tensor([0, 10, 511, 512, 1023, 4095])
    got = log_n_scale(positions, 512)
    expected = [1, 1, 1, math.log(513) / math.log(512), math.log(1024) / math.log(512), 12 / 9]
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    with_yarn = query_scale(ExtensionSettings(method="yarn", factor=4.0, log_n=True, train_length=512), positions)
    assert with_yarn.tolist() == pytest.approx([e * (0.1 * math.log(4) + 1) ** 2 for e in expected])


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
    assert torch.allclose(got_real, expected.real) and torch.allclose(got_imag, expected.imag)
