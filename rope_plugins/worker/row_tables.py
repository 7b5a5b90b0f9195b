"""Each row's rule as row-indexed tensors (:class:`RowTables`): frequencies, window, leak,
query-scale terms from :data:`rope_plugins.rules.methods.METHODS`, written once when a request
joins, so a step needs no loop over requests."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, fields

import torch

from rope_plugins.rules.checkpoint import CheckpointRotary
from rope_plugins.rules.methods import inv_freq, method_of
from rope_plugins.rules.settings import ExtensionSettings


@dataclass(frozen=True)
class RowValues:
    """One row's rule (see :mod:`rope_plugins.rules.methods`)."""

    theta: torch.Tensor  # [d/2] float64
    window: int  # w; 0 for the frequency methods
    leak: float  # ρ: 0 ReRoPE, 1/k Leaky ReRoPE, 1 the frequency methods
    far_origin: int  # o: far relative positions are o + (r - w) ρ; w but in STRING (its local value)
    log_n_length: float  # the training length log-n divides by; 0 when log-n is off
    query_factor: float  # on the query: the method's own (YaRN's temperature) x the checkpoint's
    group: int  # g: far positions floored to groups of g (Self-Extend); 0 keeps them continuous
    dynamic_length: int  # L of a factor that follows the length (ntk_dynamic); 0 for a fixed θ
    theta_exponent: torch.Tensor  # [d/2] float64: each query's θ is theta k^(-exponent); zeros when fixed
    chunk_length: int  # s: far keys at n mod s, the window following the query (dual-chunk); 0: no chunks


def row_values(settings: ExtensionSettings, rotary: CheckpointRotary) -> RowValues:
    method = method_of(settings)
    exponent = method.dynamic_exponent(settings, rotary.head_dim)
    window, far_origin = method.window(settings), method.far_origin(settings)
    return RowValues(theta=inv_freq(settings, rotary), window=window, leak=method.leak(settings),
                     far_origin=window if far_origin is None else far_origin,
                     log_n_length=float(settings.train_length) if settings.log_n else 0.0,
                     query_factor=method.query_factor(settings) * rotary.attention_factor**2,
                     group=method.group(settings), dynamic_length=settings.train_length if exponent is not None else 0,
                     theta_exponent=exponent if exponent is not None else torch.zeros(rotary.head_dim // 2,
                                                                                        dtype=torch.float64),
                     chunk_length=method.chunk_length(settings))


# Distinct settings seen by a worker: each costs a few hundred bytes; a bounded cache keeps a
# stream of ever-different requests from growing the worker without limit.
ROW_VALUES_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=ROW_VALUES_CACHE_SIZE)
def cached_row_values(settings: ExtensionSettings, rotary: CheckpointRotary) -> RowValues:
    """:func:`row_values`, once per distinct settings (frozen, so hashable)."""
    return row_values(settings, rotary)


class RowTables:
    """:class:`RowValues` of every row (batch row on V1, request slot on V2), as row-indexed tensors."""

    def __init__(self, rows: int, pairs: int):
        self.theta = torch.zeros(rows, pairs, dtype=torch.float64)
        self.window = torch.zeros(rows, dtype=torch.int64)
        self.leak = torch.ones(rows, dtype=torch.float64)
        self.far_origin = torch.zeros(rows, dtype=torch.int64)
        self.log_n_length = torch.zeros(rows, dtype=torch.float64)
        self.query_factor = torch.ones(rows, dtype=torch.float64)
        self.group = torch.zeros(rows, dtype=torch.int64)
        self.dynamic_length = torch.zeros(rows, dtype=torch.int64)
        self.theta_exponent = torch.zeros(rows, pairs, dtype=torch.float64)
        self.chunk_length = torch.zeros(rows, dtype=torch.int64)

    def _tables(self) -> tuple[torch.Tensor, ...]:
        # in RowValues' order
        return (self.theta, self.window, self.leak, self.far_origin, self.log_n_length, self.query_factor, self.group,
                self.dynamic_length, self.theta_exponent, self.chunk_length)

    def write(self, row: int, values: RowValues) -> None:
        for table, field in zip(self._tables(), fields(values)):
            table[row] = getattr(values, field.name)

    def copy_row(self, source: int, target: int) -> None:
        for table in self._tables():
            table[target] = table[source]

    def swap_rows(self, a: int, b: int) -> None:
        for table in self._tables():
            table[[a, b]] = table[[b, a]]

    def gather(self, rows: torch.Tensor) -> RowTables:
        """A copy holding ``rows``, in that order."""
        taken = copy.copy(self)
        (taken.theta, taken.window, taken.leak, taken.far_origin, taken.log_n_length, taken.query_factor, taken.group,
         taken.dynamic_length, taken.theta_exponent, taken.chunk_length) = (table[rows] for table in self._tables())
        return taken
