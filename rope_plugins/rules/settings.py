"""One typed, validated settings object for every context-extension method.

The same object is built from the engine's defaults, from a request's settings resolved at the
edge (the project's server: :func:`rope_plugins.server.extension.resolve_extension`, which holds
both meanings of ``auto``) and from ``SamplingParams.extra_args``; a bad value raises
:class:`SettingsError`, which names the field and says why. The methods and the fields each one
uses come from :data:`rope_plugins.rules.methods.METHODS`.

A request's settings travel in ``SamplingParams.extra_args``: as one object under
``EXTRA_ARGS_KEY`` (what the project's server writes), or as flat ``context_extension.<field>``
keys (what a client of stock ``vllm serve`` can send in ``vllm_xargs``, whose values are flat);
the engine's defaults in the model config (``hf_config.rope_extension``), which every worker
receives.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rope_plugins.rules.methods import METHODS

MethodName = Literal[tuple(METHODS)]
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)

AUTO = "auto"  # a method or factor chosen per request at the edge (rope_plugins.server.extension)
EXTRA_ARGS_KEY = "context_extension"  # SamplingParams.extra_args key of a request's settings
CONFIG_KEY = "rope_extension"  # hf_config attribute (set through hf_overrides): the engine's defaults
# extra_args keys "context_extension.<field>": one field each (vllm_xargs, which takes no objects)
FLAT_PREFIX = EXTRA_ARGS_KEY + "."
# additional_config key: the engine's front end salts every request's prefix cache by its settings
# (rope_plugins.frontend.engine_args.extension_request does); see tracker.check_settings_policy
SALTED_KEY = "rope_extension_salted_requests"


# The largest training length (and so window) a setting may name: past any context served
# today, and small enough that every derived value fits the worker's int64 / float64 tables.
MAX_POSITIONS = 1 << 24
# The extension factor of the frequency methods.
MIN_FACTOR, MAX_FACTOR = 1.0, 1024.0
# Leaky ReRoPE's slope divisor: at 65536 the far keys are already flat (ReRoPE itself).
MAX_LEAKY_K = 65536.0
# Self-Extend's group sizes: powers of two up to 64, so that every 64-key step of the CPU decode
# kernel's far-angle walk (csrc/decode_attention.cpp) holds whole groups and its split of a
# key's angle into step + offset stays exact.
SELF_EXTEND_GROUPS = (1, 2, 4, 8, 16, 32, 64)
# STRING's default local value W (its paper's 128), at most half of the shift on short models
STRING_LOCAL = 128
# Dual-chunk attention's chunk length (chunk_size - local_window) is a whole number of these:
# the CPU decode kernel walks far-key angles in 64-key steps, and a step must not cross a chunk
# (where the key positions start again at 0), as the Triton prefill's 64-key tiles must not
DUAL_CHUNK_ALIGN = 64
# ntk_dynamic sizes its factor to the tokens seen rounded up to a step of this many past the
# training length: the rotation changes every 128 positions rather than at every one, so a
# prompt chunk splits into a few rows of one rotation each (planner.dynamic_sub_rows)
DYNAMIC_STEP = 128


def default_shift(train_length: int) -> int:
    """STRING's default shift S: a third of the training length (its paper's)."""
    return max(1, train_length // 3)


def default_local_window(train_length: int) -> int:
    """Dual-chunk attention's default local window: ChunkLlama's ``L / 16``."""
    return train_length // 16


def default_chunk_size(train_length: int, local_window: int) -> int:
    """Dual-chunk attention's default chunk size ``C``: ChunkLlama's ``3 L / 4``, less what makes
    its chunk length ``C - local_window`` a whole number of ``DUAL_CHUNK_ALIGN`` (at least one)."""
    chunk_length = max(DUAL_CHUNK_ALIGN, (train_length * 3 // 4 - local_window) // DUAL_CHUNK_ALIGN * DUAL_CHUNK_ALIGN)
    return chunk_length + local_window


class SettingsError(ValueError):
    """A bad extension setting: ``field`` names it, ``reason`` says why."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{self.parameter}: {reason}")

    @property
    def parameter(self) -> str:
        """The request parameter at fault: ``context_extension.<field>``, or the whole object."""
        return f"{EXTRA_ARGS_KEY}.{self.field}" if self.field else EXTRA_ARGS_KEY


class ExtensionSettings(BaseModel):
    """How one request extends its context.

    ``factor`` is the extension factor k of the frequency methods (target length / train
    length); ``window`` (w) and ``leaky_k`` belong to ReRoPE / Leaky ReRoPE; ``beta`` to
    ntk_mixed; ``log_n`` multiplies each query by max(1, log(n) / log(train_length)).
    ``window`` defaults to a quarter of ``train_length`` (the seed's best range is 1/4..1/2).
    ``shift`` (S) and ``local`` (W) belong to STRING: relative positions from S on are moved
    down to start at W; S defaults to a third of ``train_length`` and W to 128 (at most S / 2).
    ``chunk_size`` (C) and ``local_window`` belong to dual-chunk attention (ChunkLlama's names;
    Qwen2.5-1M's ``chunk_size`` and ``local_size``): chunks of ``s = C - local_window`` positions,
    ``C`` the largest relative position any query sees; ChunkLlama's defaults ``3 L / 4``
    (rounded so that ``s`` is a multiple of 64) and ``L / 16``.
    """

    # every number bounded and finite: a request's values end up in the worker's tensors
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)

    train_length: int = Field(..., gt=1, le=MAX_POSITIONS)  # declared first: window is checked against it
    method: MethodName = "none"
    factor: float = Field(4.0, ge=MIN_FACTOR, le=MAX_FACTOR)
    window: int | None = Field(None, gt=0, le=MAX_POSITIONS)
    leaky_k: float = Field(16.0, ge=1.0, le=MAX_LEAKY_K)
    beta: float = Field(0.625, ge=0.0, le=1.0)
    group: int = Field(8, ge=1, le=SELF_EXTEND_GROUPS[-1])
    shift: int | None = Field(None, gt=0, le=MAX_POSITIONS)
    local: int | None = Field(None, ge=0, le=MAX_POSITIONS)
    # local_window before chunk_size: chunk_size's check reads it
    local_window: int | None = Field(None, ge=0, le=MAX_POSITIONS)
    chunk_size: int | None = Field(None, gt=0, le=MAX_POSITIONS, validate_default=True)
    log_n: StrictBool = False

    @field_validator("window", "shift")
    @classmethod
    def _inside_training(cls, value: int | None, info: ValidationInfo) -> int | None:
        train_length = info.data.get("train_length")  # absent when it failed its own check
        if value is not None and train_length is not None and value >= train_length:
            raise ValueError(f"must be smaller than train_length ({train_length}), got {value}")
        return value

    @field_validator("local")
    @classmethod
    def _local_below_shift(cls, local: int | None, info: ValidationInfo) -> int | None:
        # far positions moved to start at W or later than where they were would not move them down
        shift, train_length = info.data.get("shift"), info.data.get("train_length")
        if shift is None and train_length is not None and "shift" in info.data:
            shift = default_shift(train_length)
        if local is not None and shift is not None and local >= shift:
            raise ValueError(f"must be smaller than shift ({shift}), got {local}")
        return local

    @field_validator("chunk_size")
    @classmethod
    def _whole_chunks(cls, chunk_size: int | None, info: ValidationInfo) -> int | None:
        # checked for dual_chunk alone: the defaults of every other method's settings need not fit
        train_length, local_window = info.data.get("train_length"), info.data.get("local_window")
        if info.data.get("method") != "dual_chunk" or train_length is None or "local_window" not in info.data:
            return chunk_size
        local_window = default_local_window(train_length) if local_window is None else local_window
        size = default_chunk_size(train_length, local_window) if chunk_size is None else chunk_size
        chunk_length = size - local_window
        if size > train_length:
            raise ValueError(f"must be at most train_length ({train_length}): it is the largest relative position "
                             f"a query sees, got {size}")
        if chunk_length <= local_window:
            raise ValueError(f"chunk_size ({size}) minus local_window ({local_window}), the chunk length, must "
                             "exceed local_window")
        if chunk_length % DUAL_CHUNK_ALIGN:
            raise ValueError(f"chunk_size ({size}) minus local_window ({local_window}) must be a multiple of "
                             f"{DUAL_CHUNK_ALIGN}, got {chunk_length}")
        return chunk_size

    @field_validator("group")
    @classmethod
    def _group_a_power_of_two(cls, group: int) -> int:
        if group not in SELF_EXTEND_GROUPS:
            raise ValueError(f"must be one of {', '.join(map(str, SELF_EXTEND_GROUPS))} (a power of two), got {group}")
        return group

    @model_validator(mode="after")
    def _default_lengths(self) -> "ExtensionSettings":
        if self.window is None:
            object.__setattr__(self, "window", max(1, self.train_length // 4))
        if self.shift is None:
            object.__setattr__(self, "shift", default_shift(self.train_length))
        if self.local is None:
            object.__setattr__(self, "local", min(STRING_LOCAL, self.shift // 2))
        if self.local_window is None:
            object.__setattr__(self, "local_window", default_local_window(self.train_length))
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", default_chunk_size(self.train_length, self.local_window))
        return self

    def canonical(self) -> dict[str, Any]:
        """The fields that change the computation, in a fixed order: two settings that compute
        the same attention share one hash (and one prefix cache)."""
        form: dict[str, Any] = {"method": self.method}
        for name in METHODS[self.method].fields:
            form[name] = getattr(self, name)
        if self.log_n:
            form["log_n"] = True
            form["train_length"] = self.train_length
        return form

    def canonical_hash(self) -> str:
        """Stable hash of :meth:`canonical`: the prefix-cache salt of a request."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def is_plain_rope(self) -> bool:
        return self.method == "none" and not self.log_n


def engine_defaults(hf_config: Any) -> ExtensionSettings:
    """The engine's default settings, from the model config the engine was built with."""
    fields = dict(getattr(hf_config, CONFIG_KEY, None) or {})
    fields.setdefault("train_length", hf_config.max_position_embeddings)
    return ExtensionSettings.model_validate(fields)


def parse_settings(fields: dict[str, Any] | None, defaults: ExtensionSettings) -> ExtensionSettings:
    """``defaults`` overridden by a request's ``fields``; raises :class:`SettingsError`."""
    if fields is None:
        return defaults
    if not isinstance(fields, dict):
        raise SettingsError("", f"must be an object, got {type(fields).__name__}")
    merged = defaults.model_dump()
    # a length derived by default follows what it is derived from: the window and the shift
    # the new train_length, the local value the new shift, the chunk size the new local window
    derived = {"window": ("train_length",), "shift": ("train_length",), "local": ("train_length", "shift"),
               "local_window": ("train_length",), "chunk_size": ("train_length", "local_window")}
    for name, sources in derived.items():
        if name not in fields and any(source in fields for source in sources):
            merged[name] = None
    merged.update(fields)
    try:
        return ExtensionSettings.model_validate(merged)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise SettingsError(field, _readable(first)) from None


def positions_used(prompt_tokens: int, max_tokens: int) -> int:
    """How many positions a request's tokens occupy: the prompt's and every generated token's
    but the last, which is sampled and never run through the model. A request with
    ``prompt + max_tokens = L + 1`` still sees only positions ``0 .. L - 1``."""
    return prompt_tokens + max(max_tokens, 1) - 1


def length_factor(positions: int, train_length: int) -> float:
    """The factor a request spanning ``positions`` (:func:`positions_used`) needs:
    ``max(1, positions / L)``; 1 inside the training length, where every frequency method is
    then plain RoPE."""
    return max(1.0, positions / train_length)


def request_fields(params: Any) -> Any:
    """A request's own (partial) settings, from its ``SamplingParams``: the object under
    ``context_extension``, or the flat ``context_extension.<field>`` keys gathered into one
    (a JSON ``true`` / ``false`` reaches ``vllm_xargs`` as 1 / 0: ``log_n`` takes them back);
    None when it names none. Both forms at once raise :class:`SettingsError`."""
    extra = params.extra_args or {}
    flat = {key[len(FLAT_PREFIX):]: value for key, value in extra.items()
            if isinstance(key, str) and key.startswith(FLAT_PREFIX)}
    if not flat:
        return extra.get(EXTRA_ARGS_KEY)
    if EXTRA_ARGS_KEY in extra:
        raise SettingsError("", f"give the settings as one {EXTRA_ARGS_KEY!r} object or as "
                                f"'{FLAT_PREFIX}<field>' keys, not both")
    if type(flat.get("log_n")) is int and flat["log_n"] in (0, 1):
        flat["log_n"] = bool(flat["log_n"])
    return flat


def request_settings(params: Any, defaults: ExtensionSettings) -> ExtensionSettings:
    """A request's settings as they travel in its ``SamplingParams`` (:func:`request_fields`),
    over the engine's ``defaults``; raises :class:`SettingsError`."""
    return parse_settings(request_fields(params), defaults)


def validate_request_fields(fields: Any) -> None:
    """Check a request's fields on their own: wherever the model's training length is not
    known, everything but ``window < train_length`` (checked where it is)."""
    if fields is not None:
        parse_settings(fields, ExtensionSettings(train_length=MAX_POSITIONS))


def _shown(value: Any, limit: int = 60) -> str:
    """A value quoted in an error message, cut short: the message must not echo a huge input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _readable(error: dict[str, Any]) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"unknown field; known fields are {', '.join(ExtensionSettings.model_fields)}"
    if error["loc"] == ("factor",) and error["type"] == "float_type":
        return f"must be a number from {MIN_FACTOR:g} to {MAX_FACTOR:g} or {AUTO!r} (got {_shown(error.get('input'))})"
    if error["type"] == "literal_error":
        return f"unknown method {_shown(error['input'])}; choose one of {', '.join(METHOD_NAMES)}"
    if "input" in error and error["type"] != "value_error":
        return f"{message} (got {_shown(error.get('input'))})"
    return message
