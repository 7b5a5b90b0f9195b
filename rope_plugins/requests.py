"""Per-request settings: how they travel with a request and how the worker tracks them.

A request carries its (partial) settings in ``SamplingParams.extra_args["context_extension"]``
and is salted for the prefix cache with the canonical hash of its resolved settings.
In the worker, :class:`RequestSettingsTracker` (a V1 logits processor that changes no logits)
sees every request join, leave and move inside the persistent batch, and keeps row-indexed
tensors (frequencies, window, leak, query-scale terms) that the attention metadata builder
slices each step: no per-step loop over requests.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .rotary import inv_freq, log_n_scale, yarn_attention_factor
from .settings import MAX_POSITIONS, ExtensionSettings, SettingsError, parse_settings

logger = logging.getLogger(__name__)

EXTRA_ARGS_KEY = "context_extension"
# hf_config attribute (set through hf_overrides) holding the engine's default settings.
CONFIG_KEY = "rope_extension"
ARCHITECTURE = "RopeExtendLlamaForCausalLM"


def engine_defaults(hf_config: Any) -> ExtensionSettings:
    """The engine's default settings, from the model config the engine was built with."""
    fields = dict(getattr(hf_config, CONFIG_KEY, None) or {})
    fields.setdefault("train_length", hf_config.max_position_embeddings)
    return ExtensionSettings.model_validate(fields)


def rope_base(hf_config: Any) -> float:
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


def request_fields(params: SamplingParams) -> dict[str, Any] | None:
    return (params.extra_args or {}).get(EXTRA_ARGS_KEY)


def validate_request_fields(fields: Any) -> None:
    """Check a request's fields on their own (the front end does not know the model's
    training length; a complete check happens wherever ``train_length`` is known)."""
    if fields is None:
        return
    # Without the model's training length, check everything but window < train_length.
    parse_settings(fields, ExtensionSettings(train_length=MAX_POSITIONS))


def salted_prompt(prompt: dict[str, Any], settings: ExtensionSettings) -> dict[str, Any]:
    """A prompt dict salted by the settings: no request reuses K/V made under other settings."""
    user_salt = prompt.get("cache_salt")
    salt = settings.canonical_hash() if not user_salt else f"{user_salt}:{settings.canonical_hash()}"
    return {**prompt, "cache_salt": salt}


class RowTables:
    """Row-indexed tensors describing each batch row's method as one general rule:

    a key at relative position ``r < window`` is scored at ``r`` with the row's frequencies;
    beyond it at ``window + (r - window) * leak``. Frequency methods have window 0 and leak 1,
    ReRoPE leak 0, Leaky ReRoPE leak 1/k. ``log_n_length`` is 0 when log-n is off.
    """

    def __init__(self, rows: int, pairs: int):
        self.theta = torch.zeros(rows, pairs, dtype=torch.float64)
        self.window = torch.zeros(rows, dtype=torch.int64)
        self.leak = torch.ones(rows, dtype=torch.float64)
        self.log_n_length = torch.zeros(rows, dtype=torch.float64)
        self.query_factor = torch.ones(rows, dtype=torch.float64)  # YaRN's temperature

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.theta, self.window, self.leak, self.log_n_length, self.query_factor

    def write(self, row: int, values: tuple[torch.Tensor | float | int, ...]) -> None:
        for table, value in zip(self.fields(), values):
            table[row] = value

    def copy_row(self, source: int, target: int) -> None:
        for table in self.fields():
            table[target] = table[source]

    def swap_rows(self, a: int, b: int) -> None:
        for table in self.fields():
            table[[a, b]] = table[[b, a]]


def row_values(settings: ExtensionSettings, head_dim: int, base: float) -> tuple:
    if settings.method == "rerope":
        window, leak = settings.window, 0.0
    elif settings.method == "leaky_rerope":
        window, leak = settings.window, 1.0 / settings.leaky_k
    else:
        window, leak = 0, 1.0
    query_factor = yarn_attention_factor(settings.factor) ** 2 if settings.method == "yarn" else 1.0
    log_n_length = float(settings.train_length) if settings.log_n else 0.0
    return inv_freq(settings, head_dim, base), window, leak, log_n_length, query_factor


# Distinct settings seen by a worker: each costs a few hundred bytes; a bounded cache keeps a
# stream of ever-different requests from growing the worker without limit.
ROW_VALUES_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=ROW_VALUES_CACHE_SIZE)
def cached_row_values(settings: ExtensionSettings, head_dim: int, base: float) -> tuple:
    """:func:`row_values`, once per distinct settings (frozen, so hashable)."""
    return row_values(settings, head_dim, base)


class RequestSettingsTracker(LogitsProcessor):
    """Keeps the batch rows' settings for the attention builder; leaves logits alone."""

    # One tracker per engine in this process, found by the engine's config object. The
    # builder and this processor are both constructed by the same model runner with the
    # same VllmConfig, and vLLM offers no other channel between them.
    _by_config: dict[int, "RequestSettingsTracker"] = {}

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        hf_config = vllm_config.model_config.hf_config
        self.defaults = engine_defaults(hf_config)
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.base = rope_base(hf_config)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.tables = RowTables(rows, self.head_dim // 2)
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

    def _values(self, settings: ExtensionSettings) -> tuple:
        return cached_row_values(settings, self.head_dim, self.base)

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


def log_n_factor(positions: torch.Tensor, log_n_length: torch.Tensor) -> torch.Tensor:
    """Per token log-n factor under its row's training length; 1 where ``log_n_length`` is 0."""
    factor = log_n_scale(positions, log_n_length.clamp(min=2.0))
    return torch.where(log_n_length > 0, factor, torch.ones_like(factor))
