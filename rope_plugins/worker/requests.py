"""The worker side of per-request settings: which rule each request runs, for the attention
metadata builder.

Each model runner keeps the settings of the requests it holds in row-indexed tensors
(:class:`RowTables`: frequencies, window, leak, query-scale terms, from
:data:`rope_plugins.rules.methods.METHODS`), written once when a request joins, so a step needs no
loop over requests. vLLM has two runners and each tells a different object about requests:

- V1 (the CPU build's): :class:`RequestSettingsTracker`, a V1 logits processor that changes no
  logits, sees requests join, leave and move inside the persistent batch; its row r is batch
  row r.
- V2 (the default where Triton works, i.e. GPUs): the model's state
  (:mod:`rope_plugins.worker.model_state`) sees each request join in its persistent slot
  (:class:`RequestSlots`); a step's rows are gathered by ``req_idx``.

:func:`step_tables` gives the builder the step's rows in batch order on either runner. Bad
settings are refused at admission by ``validate_params``: the tracker's on V1,
:class:`RequestSettingsAdmission`'s on V2; here they are only deserialised from ``extra_args``
over the engine's default, under one guard (:meth:`RequestRows.add`). Both admit any valid
settings, for a front end that salts each request's prefix cache by its settings
(``engine_kwargs``' callers); under stock ``vllm serve`` :mod:`rope_plugins.serve`'s subclasses
admit only what cannot share blocks computed under other settings.
:func:`check_settings_policy` refuses, at engine start, an engine guarded by neither.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from rope_plugins.rules.checkpoint import checkpoint_rotary
from rope_plugins.rules.settings import (
    SALTED_KEY,
    ExtensionSettings,
    SettingsError,
    engine_defaults,
    request_fields,
    request_settings,
    validate_request_fields,
)

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

from rope_plugins.worker.row_tables import RowTables, RowValues, cached_row_values

logger = logging.getLogger(__name__)


def refuse_bad_settings(sampling_params: SamplingParams) -> None:
    """Raises naming the field when a request's own settings are invalid; vLLM's front end turns
    it into an HTTP 400 (and ``vllm.LLM`` raises it)."""
    try:
        validate_request_fields(request_fields(sampling_params))
    except SettingsError as error:
        raise VLLMValidationError(str(error), parameter=error.parameter) from None


class RequestRows:
    """The settings of every row, each on the engine defaults until a request is written there,
    registered for the metadata builder under the engine's config.

    The builder and the object that sees requests (the V1 tracker, or the V2 model state) are
    built by the same model runner from the same ``VllmConfig`` object, and vLLM offers no
    other channel between them: the builder is given only its layers and that config.
    """

    # weak: an engine's entry goes with it
    _by_config: weakref.WeakValueDictionary[int, RequestRows] = weakref.WeakValueDictionary()

    def __init__(self, vllm_config) -> None:
        hf_config = vllm_config.model_config.hf_config
        self.defaults = engine_defaults(hf_config)
        self.rotary = checkpoint_rotary(hf_config)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.tables = RowTables(rows, self.rotary.head_dim // 2)
        self.settings: list[ExtensionSettings] = [self.defaults] * rows
        for row in range(rows):
            self.tables.write(row, self._values(self.defaults))
        RequestRows._by_config[id(vllm_config)] = self

    @classmethod
    def for_config(cls, vllm_config) -> RequestRows | None:
        return cls._by_config.get(id(vllm_config))

    def step_tables(self, common: CommonAttentionMetadata) -> RowTables:
        """This step's rows' tables, row i for batch row i."""
        raise NotImplementedError

    def _values(self, settings: ExtensionSettings) -> RowValues:
        return cached_row_values(settings, self.rotary)

    def add(self, row: int, params: SamplingParams) -> None:
        """The row's settings, deserialised as admission let them in, and its table values.
        The engine's one guard: any failure (settings that bypassed admission, a value that passed
        it and still fails) runs the row on the engine defaults, since an exception here would
        kill the engine and every request in it."""
        settings = None
        try:
            settings = request_settings(params, self.defaults)
            values = self._values(settings)
        except SettingsError as error:
            logger.warning("request settings rejected in the worker (%s); using the engine defaults", error)
            settings, values = self.defaults, self._values(self.defaults)
        except Exception:
            logger.exception("request settings %s failed in the worker; using the engine defaults",
                             settings.canonical() if settings is not None else "(unreadable)")
            settings, values = self.defaults, self._values(self.defaults)
        self.settings[row] = settings
        self.tables.write(row, values)


def step_tables(vllm_config, common: CommonAttentionMetadata) -> RowTables:
    """The settings of a step's rows for the metadata builder, row i for batch row i, on
    whichever model runner the engine has."""
    rows = RequestRows.for_config(vllm_config)
    if rows is None:
        raise RuntimeError(
            "rope_plugins: no request settings for this engine; build it with "
            "rope_plugins.frontend.engine_args.engine_kwargs(...), which installs them for the engine's model runner")
    return rows.step_tables(common)


class RequestSettingsTracker(RequestRows, LogitsProcessor):
    """V1 runner: keeps the batch rows' settings for the attention builder; leaves logits alone."""

    # Whether validate_params itself refuses settings that could read prefix-cache blocks computed
    # under other settings (rope_plugins.serve's processors). This one admits any valid settings:
    # safe where the front end salts every request by its settings, or prefix caching is off.
    guards_prefix_cache: ClassVar[bool] = False

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        RequestRows.__init__(self, vllm_config)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        refuse_bad_settings(sampling_params)

    def step_tables(self, common: CommonAttentionMetadata) -> RowTables:
        return self.tables  # rows 0..num_reqs-1 are the batch's

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            self.add(index, params)
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


class RequestSlots(RequestRows):
    """V2 runner: the settings of each persistent request slot (held by the model state)."""

    def step_tables(self, common: CommonAttentionMetadata) -> RowTables:
        if common.req_idx is None:
            raise RuntimeError("rope_plugins: the V2 runner gave this step no req_idx (each row's request slot)")
        return self.tables.gather(torch.from_numpy(common.req_idx))


class RequestSettingsAdmission(V2LogitsProcessor):
    """V2 runner: refuses bad settings at admission, the only per-request check V2 runs in the
    front end. It takes no request (``add_request`` is False: no logits work is asked for on its
    account) and its ``apply`` changes nothing; the settings live in the model state (on every
    pipeline rank; this processor exists on the last only)."""

    guards_prefix_cache: ClassVar[bool] = False  # as RequestSettingsTracker's

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        refuse_bad_settings(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        return logits


SERVE_FLAGS = ("--logits-processors rope_plugins.serve:SettingsTracker (SettingsAdmission on the V2 runner) and "
               "--middleware rope_plugins.serve.EngineSettings (python -m rope_plugins.serve prints the whole command)")


def configured_processors(vllm_config) -> list[type]:
    """The logits processor classes the engine was given: classes, or "module:Class" names (how
    ``vllm serve --logits-processors`` gives them)."""
    classes = []
    for entry in vllm_config.model_config.logits_processors or ():
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = getattr(importlib.import_module(module), name)
        classes.append(entry)
    return classes


def check_settings_policy(vllm_config) -> None:
    """Refuses, at engine start (the model's constructor, in every worker), an engine whose
    requests' settings go unchecked, or could read prefix-cache blocks computed under other
    settings. Keys are cached unrotated, but every later layer's K/V are computed from attention
    outputs and depend on the settings, and vLLM keys its prefix cache by the tokens, LoRA,
    multimodal inputs and ``cache_salt`` only: requests under different settings must either
    carry different salts (the project's server salts each by its settings), or never share
    blocks (prefix caching off), or be refused (rope_plugins.serve's processors)."""
    ours = [cls for cls in configured_processors(vllm_config)
            if isinstance(cls, type) and issubclass(cls, (RequestSettingsTracker, RequestSettingsAdmission))]
    if not ours:
        raise ValueError("rope_plugins: the engine has no request-settings processor; build it with rope_plugins."
                         f"frontend.engine_args.engine_kwargs(...), or under vllm serve pass {SERVE_FLAGS}")
    if any(cls.guards_prefix_cache for cls in ours):
        return
    if vllm_config.cache_config.enable_prefix_caching and not (vllm_config.additional_config or {}).get(SALTED_KEY):
        names = ", ".join(f"{cls.__module__}:{cls.__qualname__}" for cls in ours)
        raise ValueError(
            f"rope_plugins: {names} admits every request's own settings, and with prefix caching on a request "
            "could then reuse K/V cached under other settings; it is meant for a front end that salts every "
            f"request's prefix cache by its settings (the project's server). Under vllm serve pass {SERVE_FLAGS}, "
            "or turn prefix caching off (--no-enable-prefix-caching)")
