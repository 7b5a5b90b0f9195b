"""A request's ``context_extension``, resolved once, at the edge.

:func:`resolve_extension` is the one function that turns a request's typed fields
(:class:`~rope_plugins.server.schemas.ContextExtension`), the server's defaults
(:class:`ServerDefaults`) and the positions the request occupies into the
:class:`~rope_plugins.rules.settings.ExtensionSettings` that travels to the kernel. It holds
both meanings of ``auto`` (a method chosen by the evaluated rule of
:mod:`rope_plugins.server.auto`, a factor sized to the request) and every bound: the settings'
own, and a ``train_length`` within what this server serves.

In this process the settings travel under one name, :data:`EXTENSION_KEY`, on the objects vLLM
hands from one seam to the next: a :class:`RequestExtension` on vLLM's request model (the typed
request, set by the route; the settings applied to each prompt, set when it is rendered, read
for the response's header and body), and each prompt's settings on its engine input (taken by
``ExtensionEngine.generate``, which writes them into the request's ``SamplingParams.extra_args``
and ``cache_salt``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rope_plugins.rules.settings import (
    AUTO,
    MAX_POSITIONS,
    ExtensionSettings,
    SettingsError,
    length_factor,
    parse_settings,
)
from rope_plugins.server.auto import auto_settings
from rope_plugins.server.config import ServerConfig
from rope_plugins.server.schemas import ContextExtension

# vLLM's request model carries a RequestExtension under this name (the route sets it; a client
# cannot), and each engine input its prompt's settings
EXTENSION_KEY = "rope_extend"


@dataclass
class RequestExtension:
    """One request's ``context_extension`` as typed, and the settings each prompt resolved to."""

    requested: ContextExtension | None
    applied: list[ExtensionSettings] = field(default_factory=list)


@dataclass(frozen=True)
class ServerDefaults:
    """What a request's unset fields take: the flags' (``method`` and ``factor`` may be
    ``auto``) over the engine's default (the checkpoint's training length, each number's own
    default), and what ``auto`` runs past the training length. Known before the engine starts."""

    flags: dict[str, Any]
    engine_default: ExtensionSettings
    auto_method: str | None
    auto_log_n: bool  # log-n with --auto-method past training, unless the request sets log_n
    served: int  # the longest prompt + completion served

    @classmethod
    def of(cls, config: ServerConfig, engine_default: ExtensionSettings) -> ServerDefaults:
        return cls(flags=config.extension_defaults(), engine_default=engine_default, auto_method=config.auto_method,
                   auto_log_n=config.log_n or config.auto_log_n, served=config.max_model_len)

    @property
    def longest_train_length(self) -> int:
        """The longest training length a request may name: the longer of the served context and
        the checkpoint's own."""
        return max(self.served, self.engine_default.train_length)


def engine_default_fields(config: ServerConfig) -> dict[str, Any]:
    """The engine's default settings, what a request that names none runs there (the worker's
    fallback): the flags' numbers, never ``auto`` (this server resolves it for every request),
    and a method that serves past the training length, which the engine is built for."""
    fields = {name: value for name, value in config.extension_defaults().items()
              if name != "method" and not (name == "factor" and value == AUTO)}
    fields["method"] = (config.auto_method or "rerope") if config.method == AUTO else config.method
    if fields["method"] == "none" and not config.log_n:
        fields["method"] = "rerope"
    return fields


def resolve_extension(requested: ContextExtension | None, defaults: ServerDefaults,
                      positions: int) -> ExtensionSettings:
    """The settings a request spanning ``positions`` (``settings.positions_used``) runs: the
    server's defaults overridden by the request's own fields. ``method: "auto"`` is the evaluated
    rule for those positions (:func:`auto_settings`), or past the training length
    ``--auto-method`` at its defaults (log-n under ``--auto-log-n``), and the fields the request
    sets itself stay; ``factor: "auto"`` is what those positions need (``length_factor``).
    Raises :class:`SettingsError` naming the field."""
    fields = requested.fields() if requested is not None else {}
    merged = {**defaults.flags, **fields}
    if merged.get("factor") == AUTO:
        merged = _factor_sized(merged, positions, defaults)
    if merged.get("method") == AUTO:
        chosen = _auto_method(merged, positions, defaults)
        merged.update({name: value for name, value in chosen.items() if name == "method" or name not in fields})
    settings = parse_settings(merged, defaults.engine_default)
    longest = defaults.longest_train_length
    if settings.train_length > longest:
        raise SettingsError("train_length", f"must be at most {longest} (the longer of the served context "
                                            f"and the checkpoint's training length), got {settings.train_length}")
    return settings


def _is_train_length(value: Any) -> bool:
    """Whether a request's raw ``train_length`` is valid (before :func:`parse_settings` says why not)."""
    return type(value) is int and 1 < value <= MAX_POSITIONS


def _factor_sized(merged: dict[str, Any], positions: int, defaults: ServerDefaults) -> dict[str, Any]:
    """``factor: "auto"`` as the number the request's positions need at its training length:
    what the engine runs, the response reports and the prefix cache is salted by."""
    train_length = merged.get("train_length", defaults.engine_default.train_length)
    if not _is_train_length(train_length):
        return {name: value for name, value in merged.items() if name != "factor"}  # train_length's error is the one
    return {**merged, "factor": length_factor(positions, train_length)}


def _auto_method(merged: dict[str, Any], positions: int, defaults: ServerDefaults) -> dict[str, Any]:
    train_length = merged.get("train_length", defaults.engine_default.train_length)
    if not _is_train_length(train_length):
        return {"method": defaults.auto_method or "none"}  # train_length's own error comes next
    if positions <= train_length or defaults.auto_method is None:
        return auto_settings(positions, train_length)
    return {"method": defaults.auto_method, "log_n": defaults.auto_log_n}


def attach_extension(request: Any, requested: ContextExtension | None) -> None:
    """The typed ``context_extension`` onto vLLM's request, for the renderer's checks."""
    setattr(request, EXTENSION_KEY, RequestExtension(requested))


def requested_extension(request: Any) -> ContextExtension | None:
    """The typed ``context_extension`` the route put on vLLM's request (None: the defaults)."""
    extension = getattr(request, EXTENSION_KEY, None)
    return extension.requested if extension is not None else None


def applied_settings(request: Any) -> list[ExtensionSettings]:
    """The settings each of the request's prompts was resolved to when it was rendered."""
    extension = getattr(request, EXTENSION_KEY, None)
    return extension.applied if extension is not None else []


def carry_settings(request: Any, engine_inputs: list[Any], applied: list[ExtensionSettings]) -> None:
    """Each prompt's settings on its engine input, for the engine, and all on vLLM's request,
    for the response."""
    for engine_input, settings in zip(engine_inputs, applied):
        engine_input[EXTENSION_KEY] = settings
    extension = getattr(request, EXTENSION_KEY, None)
    if extension is None:  # a request no route of this server typed (vLLM's own handlers)
        extension = RequestExtension(None)
        setattr(request, EXTENSION_KEY, extension)
    extension.applied = applied
