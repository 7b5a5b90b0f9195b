"""The reference oracle: slow, plain, obviously right.

For every method it builds the full matrix of effective relative positions, rotates each key
explicitly by the angle its query sees it at, and runs a float64 causal softmax attention over
the whole sequence with GQA. Every fast path is tested against this.

It shares no code with what it checks (:mod:`rope_plugins.rules.rotary`, :mod:`rope_plugins.rules.methods`):
every formula is transcribed here from its source, in Python floats: the seeds' digit
equations for the NTK variants (seed 000, ``θ_m`` with ``m = 1 .. d/2``), position
interpolation's ``θ / k``, YaRN's NTK-by-parts as its reference code defines it (the ramp
between the correction dimensions of 32 and 1 rotations) with the temperature
``sqrt(1/t) = 0.1 ln s + 1``, ReRoPE's and Leaky ReRoPE's positions (seed 003), Self-Extend's
grouped positions (LongLM, Algorithm 1), STRING's shifted positions (An et al., ICLR 2025,
HKUNLP/STRING), dual-chunk attention's chunked positions (ChunkLlama, An et al., ICML 2024,
its reference code's query and key tables), dynamic NTK's base at each query's length
(transformers' "dynamic" rope), log-n's ``max(1, log_L n)``; the rotation is the
complex product. The tests compare PI and YaRN with transformers' own rope initialisation too.
"""

from __future__ import annotations

import math

import torch

from rope_plugins.rules.settings import DYNAMIC_STEP, ExtensionSettings

YARN_FAST_ROTATIONS, YARN_SLOW_ROTATIONS = 32, 1  # the YaRN paper's alpha / beta bounds (in rotations)


def _ntk_frequencies(settings: ExtensionSettings, head_dim: int, base: float) -> list[float]:
    """Seed 000: digit ``m = 1 .. d/2`` turns ``n / (β^(m-1) λ_1 ... λ_m)`` per position ``n``,
    ``β = b^(2/d)``; old is base ``βλ`` with ``λ = k^(2/d)``, fixed divides old by ``λ`` once
    more, mixed has ``λ_1 ... λ_m = exp(a m^b)`` with ``a (d/2)^b = ln k``."""
    beta, k, digits = base ** (2 / head_dim), settings.factor, range(1, head_dim // 2 + 1)
    lam = k ** (2 / head_dim)
    if settings.method == "ntk_old":
        return [1 / (beta * lam) ** (m - 1) for m in digits]
    if settings.method == "ntk_fixed":
        return [1 / (lam * (beta * lam) ** (m - 1)) for m in digits]
    a = math.log(k) / (head_dim / 2) ** settings.beta
    return [1 / (beta ** (m - 1) * math.exp(a * m**settings.beta)) for m in digits]


def _yarn_frequencies(settings: ExtensionSettings, head_dim: int, base: float) -> list[float]:
    """Pairs that turn more than 32 times over the training length keep their frequency,
    pairs turning less than once are divided by ``s``, linearly in the pair index between."""
    def correction_dimension(rotations: float) -> float:
        return head_dim * math.log(settings.train_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dimension(YARN_FAST_ROTATIONS)), 0)
    high = min(math.ceil(correction_dimension(YARN_SLOW_ROTATIONS)), head_dim - 1)
    high = high + 0.001 if high == low else high
    frequencies = []
    for i in range(head_dim // 2):
        theta = base ** (-2 * i / head_dim)
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)
        frequencies.append(theta * (1 - interpolated) + theta / settings.factor * interpolated)
    return frequencies


def _llama3_frequencies(rope: dict, head_dim: int, base: float) -> list[float]:
    """Llama 3.1: wavelengths below ``L / high_freq_factor`` kept, above ``L / low_freq_factor``
    divided by the factor, and between, ``(1 - s) θ / factor + s θ`` with
    ``s = (L / wavelength - low) / (high - low)``."""
    length, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    frequencies = []
    for i in range(head_dim // 2):
        theta = base ** (-2 * i / head_dim)
        wavelength = 2 * math.pi / theta
        if wavelength < length / high:
            frequencies.append(theta)
        elif wavelength > length / low:
            frequencies.append(theta / factor)
        else:
            share = (length / wavelength - low) / (high - low)
            frequencies.append((1 - share) * theta / factor + share * theta)
    return frequencies


def oracle_checkpoint(rope: dict | None, head_dim: int, base: float) -> tuple[torch.Tensor, float]:
    """A checkpoint's own table and the factor its rotary puts on q and k, from its
    ``rope_parameters`` (None: plain RoPE at ``base``)."""
    kind = (rope or {}).get("rope_type", "default")
    plain = [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if kind == "default":
        return torch.tensor(plain, dtype=torch.float64), 1.0
    if kind == "linear":
        return torch.tensor([theta / rope["factor"] for theta in plain], dtype=torch.float64), 1.0
    if kind == "llama3":
        return torch.tensor(_llama3_frequencies(rope, head_dim, base), dtype=torch.float64), 1.0
    if kind == "yarn":
        declared = ExtensionSettings(method="yarn", factor=rope["factor"],
                                     train_length=rope["original_max_position_embeddings"])
        return (torch.tensor(_yarn_frequencies(declared, head_dim, base), dtype=torch.float64),
                0.1 * math.log(rope["factor"]) + 1)
    raise ValueError(f"the oracle has no {kind!r} rotary")


def oracle_frequencies(settings: ExtensionSettings, head_dim: int, base: float,
                       rope: dict | None = None) -> torch.Tensor:
    """``θ`` of the method, ``[d/2]`` float64: on a scaled checkpoint (``rope``), the
    checkpoint's table times what the method does to plain RoPE at its base."""
    if rope is not None and rope.get("rope_type", "default") != "default":
        table, _ = oracle_checkpoint(rope, head_dim, base)
        return table * oracle_frequencies(settings, head_dim, base) / oracle_checkpoint(None, head_dim, base)[0]
    if settings.method in ("ntk_old", "ntk_fixed", "ntk_mixed"):
        frequencies = _ntk_frequencies(settings, head_dim, base)
    elif settings.method == "yarn":
        frequencies = _yarn_frequencies(settings, head_dim, base)
    else:
        divisor = settings.factor if settings.method == "pi" else 1.0
        frequencies = [base ** (-2 * i / head_dim) / divisor for i in range(head_dim // 2)]
    return torch.tensor(frequencies, dtype=torch.float64)


def oracle_dynamic_length(settings: ExtensionSettings, seen: int) -> int:
    """The length dynamic NTK sizes its factor to after ``seen`` tokens: the training length
    within it, beyond it ``seen`` rounded up to a whole step (``DYNAMIC_STEP``) past it."""
    if seen <= settings.train_length:
        return settings.train_length
    return settings.train_length + math.ceil((seen - settings.train_length) / DYNAMIC_STEP) * DYNAMIC_STEP


def oracle_query_frequencies(settings: ExtensionSettings, head_dim: int, base: float, positions: torch.Tensor,
                             rope: dict | None = None) -> torch.Tensor:
    """``θ`` each query (0-based ``positions``) rotates with, ``[n, d/2]``. Dynamic NTK is
    transformers' "dynamic" rope: base ``b (s / L)^(d/(d-2))`` at sequence length ``s``
    (:func:`oracle_dynamic_length` of the ``m + 1`` tokens seen); every other method has one θ."""
    if settings.method != "ntk_dynamic":
        return oracle_frequencies(settings, head_dim, base, rope).expand(positions.numel(), -1)
    on_checkpoint = oracle_checkpoint(rope, head_dim, base)[0] / oracle_checkpoint(None, head_dim, base)[0]
    rows = []
    for m in positions.tolist():
        stretch = oracle_dynamic_length(settings, m + 1) / settings.train_length
        scaled_base = base * stretch ** (head_dim / (head_dim - 2))
        dynamic = torch.tensor([scaled_base ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
        rows.append(dynamic * on_checkpoint)
    return torch.stack(rows)


def oracle_relative_position(settings: ExtensionSettings, query_position: torch.Tensor,
                             key_position: torch.Tensor) -> torch.Tensor:
    """Seed 003: ReRoPE scores ``min(r, w)`` of ``r = m - n``; Leaky ReRoPE ``r`` below ``w`` and
    ``w + (r - w) / k`` from it. LongLM's Self-Extend: neighbours (``r < w``) at ``r``, the rest
    as the grouped query position ``m // g + w - w // g`` minus the grouped key position ``n // g``.
    STRING: ``r`` below its shift ``S``, else ``r - S + W`` (its local value). Dual-chunk
    attention (ChunkLlama): chunks of ``s = C - l``, keys at ``n mod s``, the query at ``m mod s``
    in its own chunk, at ``min(m mod s + s, C)`` in the chunk before and, in older ones, where
    the chunk-before table stands at its last offset, ``min(2 s - 1, C)``. Every other method
    the true ``r``. Positions broadcast; returns float64."""
    distance = (query_position - key_position).double()
    if settings.method == "dual_chunk":
        size = settings.chunk_size
        s = size - settings.local_window
        intra = query_position % s
        successive = torch.clamp(intra + s, max=size)
        inter = min(2 * s - 1, size)
        chunks_back = query_position // s - key_position // s
        query_at = torch.where(chunks_back == 0, intra, torch.where(chunks_back == 1, successive, inter))
        return (query_at - key_position % s).double()
    if settings.method == "self_extend":
        g, w = settings.group, settings.window
        grouped = (query_position // g + w - w // g) - key_position // g
        return torch.where(distance < w, distance, grouped.double())
    if settings.method == "rerope":
        return torch.minimum(distance, torch.tensor(float(settings.window), dtype=torch.float64))
    if settings.method == "leaky_rerope":
        return torch.where(distance < settings.window, distance,
                           settings.window + (distance - settings.window) / settings.leaky_k)
    if settings.method == "string":
        return torch.where(distance < settings.shift, distance, distance - settings.shift + settings.local)
    return distance


def oracle_query_scale(settings: ExtensionSettings, positions: torch.Tensor) -> torch.Tensor:
    """log-n (seed 000): ``max(1, log_L n)`` with ``n = m + 1`` tokens seen; YaRN: logits
    divided by ``t`` with ``sqrt(1/t) = 0.1 ln s + 1``, i.e. the query times ``1/t``."""
    temperature = (0.1 * math.log(settings.factor) + 1) ** -2 if settings.method == "yarn" else 1.0
    return torch.tensor([max(1.0, math.log(m + 1) / math.log(settings.train_length)) / temperature if settings.log_n
                         else 1 / temperature for m in positions.tolist()], dtype=torch.float64)


def rotate(x: torch.Tensor, angle: torch.Tensor, neox_style: bool = True) -> torch.Tensor:
    """Each pair of ``x[..., d]`` as a complex number times ``e^(i angle)``, ``angle [..., d/2]``
    (broadcast): pairs ``(i, i + d/2)`` (neox style) or ``(2i, 2i + 1)``."""
    half = x.shape[-1] // 2
    real, imag = (x[..., :half], x[..., half:]) if neox_style else (x[..., 0::2], x[..., 1::2])
    turned = torch.complex(real, imag) * torch.polar(torch.ones_like(angle), angle)
    if neox_style:
        return torch.cat((turned.real, turned.imag), dim=-1)
    return torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    settings: ExtensionSettings,
    *,
    base: float,
    rope: dict | None = None,
    positions: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    neox_style: bool = True,
    query_rows: torch.Tensor | None = None,
    query_rows_per_chunk: int = 64,
) -> torch.Tensor:
    """Causal attention of one sequence under ``settings``, keys and queries **unrotated**.

    query ``[seq, q_heads, d]``, key/value ``[seq, kv_heads, d]``, positions ``[seq]``
    (default ``0..seq-1``). The query at position m scores the key at n <= m as
    ``q_m^T R(-rel(m - n)) k_n`` with ``rel`` the method's effective relative position and
    ``R`` the rotation by the method's frequencies. ``rope``: the checkpoint's
    ``rope_parameters`` when its rotary is scaled. Returns ``[seq, q_heads, d]``, or only
    the rows ``query_rows`` (indices into ``seq``) asks for, ``[len(query_rows), q_heads, d]``:
    a step's new tokens cost their own rows, not the whole sequence's. ``query_rows_per_chunk``
    bounds the memory: ``rows x seq x kv_heads x d`` rotated keys at a time.
    """
    seq_len, q_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    if positions is None:
        positions = torch.arange(seq_len)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)

    theta = oracle_query_frequencies(settings, head_dim, base, positions, rope)  # [seq, d/2]
    checkpoint_factor = oracle_checkpoint(rope, head_dim, base)[1] ** 2  # on q and k alike
    scaled_query = query.double() * (oracle_query_scale(settings, positions) * checkpoint_factor)[:, None, None]
    key64, value64 = key.double(), value.double()
    wanted = torch.arange(seq_len) if query_rows is None else torch.as_tensor(query_rows, dtype=torch.int64)
    out = torch.empty(wanted.numel(), q_heads, head_dim, dtype=torch.float64)

    for start in range(0, wanted.numel(), query_rows_per_chunk):
        rows = wanted[start: start + query_rows_per_chunk]
        query_position, key_position = positions[rows, None], positions[None, :]
        causal = query_position >= key_position  # [rows, seq]
        relative = oracle_relative_position(settings, query_position, key_position).masked_fill(~causal, 0.0)
        angle = -relative[..., None] * theta[rows, None, :]  # key n as query m sees it: R(-rel) k_n
        seen_key = rotate(key64[None], angle[:, :, None, :], neox_style)  # [rows, seq, kv, d]

        q = scaled_query[rows].view(-1, kv_heads, group, head_dim)  # [rows, kv, group, d]
        scores = torch.einsum("rkgd,rskd->rkgs", q, seen_key) * softmax_scale
        scores = scores.masked_fill(~causal[:, None, None, :], float("-inf"))
        weights = scores.softmax(dim=-1)
        mixed = torch.einsum("rkgs,skd->rkgd", weights, value64)
        out[start: start + rows.numel()] = mixed.reshape(-1, q_heads, head_dim)
    return out.to(query.dtype)


def plain_rope_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    base: float,
    rope: dict | None = None,
    positions: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    neox_style: bool = True,
) -> torch.Tensor:
    """Textbook RoPE attention (rotate q and k by their absolute positions, then softmax):
    an independent check of the oracle's ``none`` method."""
    seq_len, q_heads, head_dim = query.shape
    group = q_heads // key.shape[1]
    if positions is None:
        positions = torch.arange(seq_len)
    theta = base ** (-2.0 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    angle = positions.double()[:, None, None] * theta  # [seq, 1, d/2]
    q = rotate(query.double(), angle, neox_style)
    k = rotate(key.double(), angle, neox_style).repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (softmax_scale or 1.0 / math.sqrt(head_dim))
    causal = positions[:, None] >= positions[None, :]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v).to(query.dtype)


class UnrotatedRotaryEmbedding(torch.nn.Module):
    """A transformers rotary embedding that rotates nothing (cos 1, sin 0) for full-attention
    layers: put in place of ``model.model.rotary_emb``, q and k reach the attention function
    unrotated, so an attention registered with transformers can apply any method itself.
    Other layer types (Gemma 3's sliding layers) keep ``stock``'s rotation."""

    def __init__(self, head_dim: int, stock: torch.nn.Module | None = None):
        super().__init__()
        self.head_dim, self.stock = head_dim, stock

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None, *args, **kwargs):
        if layer_type not in (None, "full_attention"):
            return self.stock(x, position_ids, layer_type, *args, **kwargs)
        shape = (*position_ids.shape, self.head_dim)
        return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)
