"""The worker side of per-request settings: which rule each row of the persistent batch runs.

:class:`RequestSettingsTracker` (a V1 logits processor that changes no logits) sees every
request join, leave and move inside the batch, and keeps row-indexed tensors (frequencies,
window, leak, query-scale terms, from :data:`rope_plugins.methods.METHODS`) that the attention
metadata builder slices each step: no per-step loop over requests.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .checkpoint import CheckpointRotary, checkpoint_rotary
from .methods import inv_freq, method_of
from .settings import (EXTRA_ARGS_KEY, ExtensionSettings, SettingsError, engine_defaults, parse_settings,
                       request_fields, validate_request_fields)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowValues:
    """One row's rule (see :mod:`rope_plugins.methods`)."""

    theta: torch.Tensor  # [d/2] float64
    window: int  # w; 0 for the frequency methods
    leak: float  # ρ: 0 ReRoPE, 1/k Leaky ReRoPE, 1 the frequency methods
    log_n_length: float  # the training length log-n divides by; 0 when log-n is off
    query_factor: float  # on the query: the method's own (YaRN's temperature) x the checkpoint's


def row_values(settings: ExtensionSettings, rotary: CheckpointRotary) -> RowValues:
    method = method_of(settings)
    return RowValues(theta=inv_freq(settings, rotary), window=method.window(settings), leak=method.leak(settings),
                     log_n_length=float(settings.train_length) if settings.log_n else 0.0,
                     query_factor=method.query_factor(settings) * rotary.attention_factor**2)


# Distinct settings seen by a worker: each costs a few hundred bytes; a bounded cache keeps a
# stream of ever-different requests from growing the worker without limit.
ROW_VALUES_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=ROW_VALUES_CACHE_SIZE)
def cached_row_values(settings: ExtensionSettings, rotary: CheckpointRotary) -> RowValues:
    """:func:`row_values`, once per distinct settings (frozen, so hashable)."""
    return row_values(settings, rotary)


class RowTables:
    """:class:`RowValues` of every batch row, as row-indexed tensors."""

    def __init__(self, rows: int, pairs: int):
        self.theta = torch.zeros(rows, pairs, dtype=torch.float64)
        self.window = torch.zeros(rows, dtype=torch.int64)
        self.leak = torch.ones(rows, dtype=torch.float64)
        self.log_n_length = torch.zeros(rows, dtype=torch.float64)
        self.query_factor = torch.ones(rows, dtype=torch.float64)

    def _tables(self) -> tuple[torch.Tensor, ...]:
        return self.theta, self.window, self.leak, self.log_n_length, self.query_factor  # RowValues' order

    def write(self, row: int, values: RowValues) -> None:
        for table, field in zip(self._tables(), fields(values)):
            table[row] = getattr(values, field.name)

    def copy_row(self, source: int, target: int) -> None:
        for table in self._tables():
            table[target] = table[source]

    def swap_rows(self, a: int, b: int) -> None:
        for table in self._tables():
            table[[a, b]] = table[[b, a]]


class RequestSettingsTracker(LogitsProcessor):
    """Keeps the batch rows' settings for the attention builder; leaves logits alone."""

    # One tracker per engine in this process, found by the engine's config object. The
    # builder and this processor are both constructed by the same model runner with the
    # same VllmConfig, and vLLM offers no other channel between them.
    _by_config: dict[int, "RequestSettingsTracker"] = {}

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        hf_config = vllm_config.model_config.hf_config
        self.defaults = engine_defaults(hf_config)
        self.rotary = checkpoint_rotary(hf_config)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.tables = RowTables(rows, self.rotary.head_dim // 2)
        self.settings: list[ExtensionSettings] = [self.defaults] * rows
        for row in range(rows):
            self.tables.write(row, self._values(self.defaults))
        RequestSettingsTracker._by_config[id(vllm_config)] = self

    @classmethod
    def for_config(cls, vllm_config) -> "RequestSettingsTracker | None":
        return cls._by_config.get(id(vllm_config))

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            validate_request_fields(request_fields(sampling_params))
        except SettingsError as error:  # vLLM turns this into an HTTP 400 naming the field
            raise VLLMValidationError(str(error), parameter=f"{EXTRA_ARGS_KEY}.{error.field}") from None

    def _values(self, settings: ExtensionSettings) -> RowValues:
        return cached_row_values(settings, self.rotary)

    def resolve(self, params: SamplingParams) -> ExtensionSettings:
        try:
            return parse_settings(request_fields(params), self.defaults)
        except SettingsError as error:  # only reachable when bypassing the front end's check
            logger.warning("request settings rejected in the worker (%s); using the engine defaults", error)
            return self.defaults

    def _add(self, row: int, params: SamplingParams) -> None:
        """The row's settings; any failure falls back to the engine defaults, since an
        exception here would kill the engine and every request in it."""
        settings = self.resolve(params)
        try:
            values = self._values(settings)
        except Exception:
            logger.exception("request settings %s failed in the worker; using the engine defaults",
                             settings.canonical())
            settings, values = self.defaults, self._values(self.defaults)
        self.settings[row] = settings
        self.tables.write(row, values)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            self._add(index, params)
        for source, target, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self.tables.swap_rows(source, target)
                self.settings[source], self.settings[target] = self.settings[target], self.settings[source]
            else:
                self.tables.copy_row(source, target)
                self.settings[target] = self.settings[source]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True
