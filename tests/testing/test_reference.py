"""The oracle itself, against textbook RoPE, hand-computed cases and the methods' limits."""

import math

import pytest
import torch

from rope_plugins.rules.settings import MAX_LEAKY_K, ExtensionSettings
from rope_plugins.testing.reference import oracle_relative_position, plain_rope_attention, reference_attention

BASE = 10000.0


def random_qkv(seq_len=40, q_heads=6, kv_heads=2, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda heads: torch.randn(seq_len, heads, head_dim, generator=generator, dtype=torch.float64)  # noqa: E731
    return make(q_heads), make(kv_heads), make(kv_heads)


def oracle(method, q, k, v, **fields):
    fields.setdefault("train_length", 64)
    return reference_attention(q, k, v, ExtensionSettings(method=method, **fields), base=BASE)


@pytest.mark.parametrize("neox_style", [True, False])
def test_none_is_textbook_rope_with_gqa(neox_style):
    q, k, v = random_qkv()
    settings = ExtensionSettings(method="none", train_length=64)
    got = reference_attention(q, k, v, settings, base=BASE, neox_style=neox_style, query_rows_per_chunk=7)
    expected = plain_rope_attention(q, k, v, base=BASE, neox_style=neox_style)
    assert torch.allclose(got, expected, atol=1e-12)


def test_gqa_equals_repeated_kv_heads():
    q, k, v = random_qkv()
    grouped = oracle("rerope", q, k, v, window=5)
    repeated = oracle("rerope", q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), window=5)
    assert torch.allclose(grouped, repeated, atol=1e-12)


def test_rerope_window_at_least_sequence_is_plain_rope():
    q, k, v = random_qkv(seq_len=30)
    assert torch.allclose(oracle("rerope", q, k, v, window=30, train_length=64), oracle("none", q, k, v), atol=1e-12)
    assert torch.allclose(oracle("rerope", q, k, v, window=29), oracle("none", q, k, v), atol=1e-12)
    assert not torch.allclose(oracle("rerope", q, k, v, window=28), oracle("none", q, k, v), atol=1e-6)


def test_leaky_with_k_one_is_plain_rope():
    q, k, v = random_qkv()
    assert torch.allclose(oracle("leaky_rerope", q, k, v, window=4, leaky_k=1.0), oracle("none", q, k, v), atol=1e-12)


def test_leaky_approaches_rerope_as_k_grows():
    q, k, v = random_qkv()
    rerope = oracle("rerope", q, k, v, window=6)
    slopes = (2, 20, 200, MAX_LEAKY_K)  # the largest slope divisor a setting may have
    gaps = [(oracle("leaky_rerope", q, k, v, window=6, leaky_k=kk) - rerope).abs().max().item() for kk in slopes]
    assert gaps[0] > gaps[1] > gaps[2] > gaps[3]
    assert gaps[3] < 1e-3 * gaps[0]


def test_pi_is_plain_rope_on_interpolated_positions():
    q, k, v = random_qkv()
    expected = plain_rope_attention(q, k, v, base=BASE, positions=torch.arange(40) / 4.0)
    assert torch.allclose(oracle("pi", q, k, v, factor=4.0), expected, atol=1e-12)


def test_ntk_old_is_plain_rope_with_a_larger_base():
    q, k, v = random_qkv()
    expected = plain_rope_attention(q, k, v, base=BASE * 8)
    assert torch.allclose(oracle("ntk_old", q, k, v, factor=8.0), expected, atol=1e-12)


def test_rerope_is_shift_invariant():
    q, k, v = random_qkv()
    settings = ExtensionSettings(method="rerope", window=5, train_length=64)
    shifted = reference_attention(q, k, v, settings, base=BASE, positions=torch.arange(40) + 1000)
    assert torch.allclose(shifted, reference_attention(q, k, v, settings, base=BASE), atol=1e-9)


def test_log_n_scales_queries_past_training_length():
    q, k, v = random_qkv(seq_len=40)
    settings = ExtensionSettings(method="none", log_n=True, train_length=16)
    got = reference_attention(q, k, v, settings, base=BASE)
    factor = torch.tensor([max(1.0, math.log(m + 1) / math.log(16)) for m in range(40)], dtype=torch.float64)
    expected = plain_rope_attention(q * factor[:, None, None], k, v, base=BASE)
    assert torch.allclose(got, expected, atol=1e-12)
    assert torch.allclose(got[:16], oracle("none", q, k, v)[:16], atol=1e-12)


def test_rerope_by_hand_three_tokens():
    # d = 2, one head, theta_0 = 1, window 1: query 2 sees key 0 at relative position min(2, 1) = 1.
    q = torch.tensor([[[1.0, 0.0]]] * 3, dtype=torch.float64)
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 1.0]]], dtype=torch.float64)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[2.0, 2.0]]], dtype=torch.float64)
    out = reference_attention(q, k, v, ExtensionSettings(method="rerope", window=1, train_length=4), base=BASE)
    # score(m, n) = q . R(-rel) k / sqrt(2), with R(a) [x, y] = [x cos a - y sin a, x sin a + y cos a]
    s = 1 / math.sqrt(2)
    scores = [math.cos(-1) * s, math.sin(1) * s, 1.0 * s]  # key0 at rel 1, key1 at rel 1, key2 at rel 0
    weights = [math.exp(x) for x in scores]
    total = sum(weights)
    expected = [(weights[0] * 1 + weights[2] * 2) / total, (weights[1] * 1 + weights[2] * 2) / total]
    assert out[2, 0].tolist() == pytest.approx(expected, rel=1e-12)
    assert out[0, 0].tolist() == pytest.approx([1.0, 0.0])  # the first token sees only itself


def rotated_half_style(x, positions, base=BASE):
    """``x [seq, heads, d]`` rotated by ``positions [seq]`` as transformers' Llama does it
    (rotate_half), in the reference implementations' own terms: nothing shared with the oracle's code."""
    d = x.shape[-1]
    theta = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angle = torch.cat((positions[:, None] * theta, positions[:, None] * theta), dim=-1)[:, None, :]
    halves = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * angle.cos() + halves * angle.sin()


def two_position_attention(q, k, v, *, near_below, far_query, far_key, base=BASE):
    """Causal float64 attention as LongLM's and HKUNLP's reference code compute their methods
    (prefill, bsz 1): two full score matrices, one of q and k rotated by their own positions,
    kept where ``0 <= m - n < near_below``, one of q rotated by ``far_query(m)`` and k by
    ``far_key(n)`` for the rest. Rotations in rotate_half style, as transformers' Llama does;
    nothing shared with the oracle's code."""
    seq_len, heads, d = q.shape
    group_of_heads = heads // k.shape[1]
    position = torch.arange(seq_len, dtype=torch.float64)
    k, v = k.repeat_interleave(group_of_heads, dim=1), v.repeat_interleave(group_of_heads, dim=1)
    near = torch.einsum("mhd,nhd->hmn", rotated_half_style(q, position, base), rotated_half_style(k, position, base))
    far = torch.einsum("mhd,nhd->hmn", rotated_half_style(q, far_query(position), base),
                       rotated_half_style(k, far_key(position), base))
    distance = position[:, None] - position[None, :]
    scores = torch.where(distance < near_below, near, far) / math.sqrt(d)
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


def longlm_self_extend(q, k, v, *, window, group):
    """Self-Extend as LongLM's reference code computes it (self_extend_patch/Llama.py): the
    neighbour pair by their own positions, the grouped pair by ``m // g + w - w // g`` and ``n // g``."""
    grouped = lambda position: torch.div(position, group, rounding_mode="floor")  # noqa: E731
    return two_position_attention(q, k, v, near_below=window, far_key=grouped,
                                  far_query=lambda position: grouped(position) + window - window // group)


@pytest.mark.parametrize("window,group", [(6, 4), (5, 2), (7, 8), (1, 16)])
def test_self_extend_is_longlms_definition(window, group):
    q, k, v = random_qkv(seq_len=60)
    expected = longlm_self_extend(q, k, v, window=window, group=group)
    assert torch.allclose(oracle("self_extend", q, k, v, window=window, group=group), expected, atol=1e-12)


def test_self_extend_limits():
    """Group 1 and a window past the sequence are plain RoPE; otherwise it differs from Leaky
    ReRoPE at the same slope (positions floored) and from plain RoPE."""
    q, k, v = random_qkv(seq_len=40)
    plain = oracle("none", q, k, v)
    assert torch.allclose(oracle("self_extend", q, k, v, window=6, group=1), plain, atol=1e-12)
    assert torch.allclose(oracle("self_extend", q, k, v, window=40, group=8), plain, atol=1e-12)
    grouped = oracle("self_extend", q, k, v, window=6, group=4)
    assert not torch.allclose(grouped, plain, atol=1e-6)
    assert not torch.allclose(grouped, oracle("leaky_rerope", q, k, v, window=6, leaky_k=4.0), atol=1e-6)


def test_self_extend_positions_by_hand():
    """Window 6, group 4: the query at 20 sees key 3 at 20 // 4 + 6 - 6 // 4 - 3 // 4 = 10, key 15
    (distance 5 < 6) at 5, key 14 at 5 + 6 - 1 - 3 = 7."""
    settings = ExtensionSettings(method="self_extend", window=6, group=4, train_length=64)
    got = oracle_relative_position(settings, torch.tensor(20), torch.tensor([3, 15, 14, 20]))
    assert got.tolist() == [10.0, 5.0, 7.0, 0.0]


def hkunlp_string(q, k, v, *, shift, local):
    """STRING as HKUNLP/STRING describes it: the same keys (at their own positions) against each
    query at its own position for the pairs closer than the shift ``S``, and moved back to
    ``m - S + W`` for the rest (relative positions from ``S`` on start again at the local value ``W``)."""
    return two_position_attention(q, k, v, near_below=shift, far_query=lambda position: position - shift + local,
                                  far_key=lambda position: position)


@pytest.mark.parametrize("shift,local", [(20, 5), (13, 0), (7, 6), (1, 0)])
def test_string_is_hkunlps_definition(shift, local):
    q, k, v = random_qkv(seq_len=60)
    expected = hkunlp_string(q, k, v, shift=shift, local=local)
    assert torch.allclose(oracle("string", q, k, v, shift=shift, local=local), expected, atol=1e-12)


def test_string_limits_and_positions_by_hand():
    """A shift past the sequence is plain RoPE; shift 8, local 3: the query at 20 sees key 15
    (distance 5) at 5, key 12 (distance 8) at 3, key 0 at 20 - 8 + 3 = 15."""
    q, k, v = random_qkv(seq_len=40)
    assert torch.allclose(oracle("string", q, k, v, shift=40, local=3), oracle("none", q, k, v), atol=1e-12)
    assert not torch.allclose(oracle("string", q, k, v, shift=8, local=3), oracle("none", q, k, v), atol=1e-6)
    settings = ExtensionSettings(method="string", shift=8, local=3, train_length=64)
    got = oracle_relative_position(settings, torch.tensor(20), torch.tensor([15, 12, 0, 20]))
    assert got.tolist() == [5.0, 3.0, 15.0, 0.0]


def chunkllama_dual_chunk(q, k, v, *, chunk_size, local_window, base=BASE):
    """Dual-chunk attention as ChunkLlama's reference code computes it (chunkllama_attn_replace.py,
    prefill, bsz 1): chunk length ``s = chunk_size - local_window``; tables of query positions
    ``q_t = 0 .. s - 1`` and ``qc_t = clamp(q_t + s, max=chunk_size)`` and key positions ``k_t = n mod s``;
    the intra-chunk scores with q at ``q_t[m mod s]``, the successive-chunk scores at ``qc_t[m mod s]``,
    the inter-chunk ones at ``qc_t[s - 1]``, kept by how many chunks back the key lies.
    Rotations in rotate_half style; nothing shared with the oracle's code."""
    seq_len, heads, d = q.shape
    s = chunk_size - local_window
    q_t = torch.arange(s, dtype=torch.float64)
    qc_t = (q_t + s).clamp(max=chunk_size)
    position = torch.arange(seq_len)
    k_t = (position % s).double()
    k, v = k.repeat_interleave(heads // k.shape[1], dim=1), v.repeat_interleave(heads // k.shape[1], dim=1)
    keys = rotated_half_style(k, k_t, base)
    scores = {name: torch.einsum("mhd,nhd->hmn", rotated_half_style(q, table, base), keys)
              for name, table in (("intra", q_t[position % s]), ("successive", qc_t[position % s]),
                                  ("inter", qc_t[s - 1].expand(seq_len)))}
    back = position[:, None] // s - position[None, :] // s
    picked = torch.where(back == 0, scores["intra"], torch.where(back == 1, scores["successive"], scores["inter"]))
    picked = (picked / math.sqrt(d)).masked_fill(position[:, None] < position[None, :], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", picked.softmax(dim=-1), v)


@pytest.mark.parametrize("chunk_size,local_window", [(74, 10), (64, 0), (100, 36), (160, 32)])
def test_dual_chunk_is_chunkllamas_definition(chunk_size, local_window):
    q, k, v = random_qkv(seq_len=300)
    expected = chunkllama_dual_chunk(q, k, v, chunk_size=chunk_size, local_window=local_window)
    got = oracle("dual_chunk", q, k, v, chunk_size=chunk_size, local_window=local_window, train_length=200)
    assert torch.allclose(got, expected, atol=1e-12)


def test_dual_chunk_positions_by_hand():
    """Chunk size 74, local window 10: chunks of 64. The query at 140 (chunk 2, offset 12 > 10)
    sees key 130 (its chunk) at 10, key 100 (the chunk before, offset 36) at min(12 + 64, 74) - 36 =
    38, key 5 at 74 - 5 = 69; the query at 135 (offset 7 <= 10) sees key 100 at 7 + 64 - 36 = 35,
    its true distance. A sequence inside one chunk is plain RoPE."""
    settings = ExtensionSettings(method="dual_chunk", chunk_size=74, local_window=10, train_length=200)
    got = oracle_relative_position(settings, torch.tensor(140), torch.tensor([130, 100, 5, 140]))
    assert got.tolist() == [10.0, 38.0, 69.0, 0.0]
    assert oracle_relative_position(settings, torch.tensor(135), torch.tensor(100)).item() == 35.0
    q, k, v = random_qkv(seq_len=64)
    assert torch.allclose(oracle("dual_chunk", q, k, v, chunk_size=74, local_window=10, train_length=200),
                          oracle("none", q, k, v), atol=1e-12)


@pytest.mark.parametrize("method", ["rerope", "leaky_rerope", "yarn", "self_extend", "string", "dual_chunk"])
def test_chosen_query_rows_are_those_rows_of_the_whole_answer(method):
    """``query_rows``: only those rows computed (in any order, chunked), each equal to its row
    of the whole sequence's answer; the keys are still every earlier one."""
    q, k, v = random_qkv(seq_len=150)  # three chunks of dual_chunk's 64
    fields = {"rerope": dict(window=7), "leaky_rerope": dict(window=5, leaky_k=3.0), "yarn": dict(factor=4.0),
              "self_extend": dict(window=6, group=4), "string": dict(shift=9, local=2),
              "dual_chunk": dict(chunk_size=68, local_window=4, train_length=100)}[method]
    settings = ExtensionSettings(method=method, log_n=True, **{"train_length": 16, **fields})
    whole = reference_attention(q, k, v, settings, base=BASE)
    rows = torch.tensor([149, 0, 17, 130, 30])
    chosen = reference_attention(q, k, v, settings, base=BASE, query_rows=rows, query_rows_per_chunk=2)
    assert chosen.shape == (5, 6, 16)
    assert torch.allclose(chosen, whole[rows], rtol=0, atol=1e-12)  # equal but for the sums' order


def test_each_reference_model_answers_for_itself(tmp_path):
    """transformers' attention registry is global: a second family's oracle model built after
    the first must not answer for it (the engines' tests share one session-wide oracle)."""
    from tests.support.reference_forward import ReferenceModel
    from tests.support.tiny_models import TRAIN_LENGTH, make_tiny_model

    settings = ExtensionSettings(train_length=TRAIN_LENGTH, method="rerope", window=37)
    ids = list(range(3, 120))
    llama = ReferenceModel(make_tiny_model(tmp_path / "llama"))
    before = llama.prompt_logprobs(ids, settings)
    other = ReferenceModel(make_tiny_model(tmp_path / "qwen2", "qwen2", seed=11))
    other.prompt_logprobs(ids, settings.model_copy(update={"method": "none"}))
    assert torch.equal(llama.prompt_logprobs(ids, settings), before)
