"""One attention step on a hand-made paged cache, and the float64 oracle's answer for it: how
the tests (tests/attention/test_attention.py, tests/ops/test_gpu.py) and tests/ops/gpu_check.py
check the attention's ops without an engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rope_plugins.rules.checkpoint import CheckpointRotary
from rope_plugins.testing.reference import reference_attention
from rope_plugins.worker.row_tables import RowTables, row_values

BASE = 10000.0  # the rotary base of every step here
ORACLE_CHUNK_BYTES = 1 << 28  # the oracle's rotated keys per chunk of query rows


@dataclass(frozen=True)
class PagedStep:
    """One step's inputs on a paged cache that already holds every row's earlier keys."""

    rows: list  # (settings, context, new tokens)
    cache: torch.Tensor  # [blocks, kv, block, 2d]
    tables: RowTables
    starts: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, max blocks]
    slots: torch.Tensor  # [T]
    sequences: list  # per row (q, k, v) over all its positions
    query: torch.Tensor  # [T, heads, d]: this step's tokens
    key: torch.Tensor
    value: torch.Tensor

    def expected(self, base: float = BASE) -> torch.Tensor:
        """The float64 oracle's output for this step's query tokens (their rows only)."""
        return torch.cat([self.expected_row(r, base) for r in range(len(self.rows))])

    def expected_row(self, r: int, base: float = BASE) -> torch.Tensor:
        """The oracle's output for row ``r``'s new tokens, ``[new, heads, d]`` in float64."""
        (settings, _, new), (q, k, v) = self.rows[r], self.sequences[r]
        q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
        seq_len, kv_heads, head = k.shape
        per_query_row = 4 * seq_len * kv_heads * head * 8  # rotated keys and their complex temporaries
        return reference_attention(q, k, v, settings, base=base, query_rows=torch.arange(seq_len - new, seq_len),
                                   query_rows_per_chunk=max(1, ORACLE_CHUNK_BYTES // per_query_row))

    def to(self, device: torch.device | str) -> "PagedStep":
        """The step with its tensors on ``device`` (the row tables stay on the CPU, where plans are made)."""
        moved = {field.name: getattr(self, field.name).to(device) for field in dataclasses.fields(self)
                 if isinstance(getattr(self, field.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def draw(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, grid: torch.dtype | None):
    """Standard normal values in ``dtype``; with ``grid``, first rounded to it and, below
    float16's smallest normal, flushed to zero, so that float32, float16 and bfloat16 steps of
    the same seed hold exactly the same numbers."""
    values = torch.randn(*shape, generator=generator)
    if grid is not None:
        values = values.to(grid).float()
        values = torch.where(values.abs() < torch.finfo(torch.float16).tiny, 0.0, values)
    return values.to(dtype)


def paged_step(rows, *, seed=0, head=32, kv=2, queries_per_kv=3, block=16, dtype=torch.float32,
               grid: torch.dtype | None = None) -> PagedStep:
    """A paged cache (blocks shuffled, spare blocks left) holding each row's unrotated keys and
    values up to its context, and this step's new tokens. ``rows``: (settings, tokens in the
    cache before this step, tokens this step); ``grid``: see :func:`draw`."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: draw(generator, shape, dtype, grid)  # noqa: E731
    lengths = [context + new for _, context, new in rows]
    blocks_per_row = [-(-n // block) for n in lengths]
    cache = torch.zeros(sum(blocks_per_row) + 3, kv, block, 2 * head, dtype=dtype)
    permutation = torch.randperm(cache.shape[0], generator=generator)
    block_table = torch.zeros(len(rows), max(blocks_per_row), dtype=torch.int64)
    sequences, start, slots = [], 0, []
    for r, n in enumerate(lengths):
        block_table[r, : blocks_per_row[r]] = permutation[start: start + blocks_per_row[r]]
        start += blocks_per_row[r]
        q, k, v = randn(n, kv * queries_per_kv, head), randn(n, kv, head), randn(n, kv, head)
        position = torch.arange(n)
        cache[block_table[r, position // block], :, position % block] = torch.cat((k, v), -1)
        sequences.append((q, k, v))
        new = rows[r][2]
        slots.append(block_table[r, position[-new:] // block] * block + position[-new:] % block)
    tables = RowTables(len(rows), head // 2)
    for r, (settings, _, _) in enumerate(rows):
        tables.write(r, row_values(settings, CheckpointRotary.plain(head, BASE, 4096)))
    new_tokens = lambda part: torch.cat([seq[part][-new:] for seq, (_, _, new) in zip(sequences, rows)])  # noqa: E731
    return PagedStep(rows=list(rows), cache=cache, tables=tables,
                     starts=torch.tensor([0] + [new for _, _, new in rows]).cumsum(0), seq_lens=torch.tensor(lengths),
                     block_table=block_table, slots=torch.cat(slots), sequences=sequences, query=new_tokens(0),
                     key=new_tokens(1), value=new_tokens(2))


def nearest_fp8(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated and rounded to the nearest ``fp8`` value: how the Triton write
    (and vLLM's CUDA cache) quantizes."""
    largest = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-largest, largest).to(fp8)


def fp8_cached(step: PagedStep, fp8: torch.dtype, key_scale: float, value_scale: float,
               quantized=nearest_fp8) -> tuple[torch.Tensor, PagedStep]:
    """``step``'s cache in ``fp8`` as bytes (keys and values divided by their scales and rounded by
    ``quantized(x, scale, fp8)``), and the step whose keys and values are the ones that cache holds
    read back: the oracle's inputs for kernels reading it."""
    head = step.cache.shape[-1] // 2
    keys, values = step.cache[..., :head], step.cache[..., head:]
    cache = torch.cat((quantized(keys, key_scale, fp8).view(torch.uint8),
                       quantized(values, value_scale, fp8).view(torch.uint8)), dim=-1)

    def read(x: torch.Tensor, scale: float) -> torch.Tensor:
        return quantized(x, scale, fp8).float() * scale

    return cache, dataclasses.replace(step, sequences=[(q, read(k, key_scale), read(v, value_scale))
                                                       for q, k, v in step.sequences])
