"""Validated settings: one immutable value built from a TOML file, env vars and flags.

Precedence, lowest to highest: built-in defaults, the TOML file (``--config``),
``FANOUT_<SECTION>_<KEY>`` environment variables (``FANOUT_LOOKUPS_<NAME>_<KEY>`` for
a lookup), command-line flags. A ``FANOUT_`` variable naming no section (the service
links Kubernetes injects) is ignored, with a debug line; an unknown key in a known
section, or anything unknown in the file, is an error.

Every value is checked once, at start-up; a bad one raises :class:`ConfigError` naming
the key. Nothing below the handler reads configuration: each part receives its section.

Each section is declared once, by the part that owns it: every key with its type,
bounds, choices, default and help (``service/settings/declarations.py`` says how)::

    [server]          ServerSettings    service/settings/server.py
    [fanout]          FanOutSettings    service/engine/settings.py
    [admission]       AdmissionSettings service/engine/settings.py
    [callers.<name>]  CallerSettings    service/engine/settings.py
    [backends.<name>] MongoBackendSettings, HttpBackendSettings  lookups/backends/settings.py
    [mongo] [http]    MongoSettings, HttpSettings    lookups/settings.py (aliases)
    [lookups.<name>]  LookupSettings    lookups/settings.py, plus the keys the
                      panel's plugin declares (``lookups.plugins.with_settings``)
    [tracing]         TracingSettings   tracing/settings.py
    [metrics]         MetricsSettings   tracing/settings.py
    [logging]         LoggingSettings   service/operations/logs.py
    [cache]           CacheSettings     lookups/cache/settings.py

This module loads, merges and composes them into :class:`Settings`; the manual's
tables of keys are made from the same declarations (``service/cli/settings_table.py``).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lookups.backends.settings import (
    ALIAS_SECTIONS,
    BACKEND_KINDS,
    BackendSettings,
    backends_from_aliases,
)
from lookups.cache.settings import CacheSettings
from lookups.settings import SHIPPED_OPTIONAL, HttpSettings, LookupSettings, MongoSettings
from service.engine.settings import (
    CALLER_PATTERN,
    CALLER_RULE,
    AdmissionSettings,
    CallerSettings,
    FanOutSettings,
)
from service.errors import ConfigError
from service.operations.logs import LoggingSettings
from service.settings.declarations import as_config_error, build_section, keys_of
from service.settings.server import ServerSettings
from tracing.settings import MetricsSettings, TracingSettings

__all__ = ["ConfigError", "ServerSettings", "Settings", "load_settings", "as_config_error"]

ENV_PREFIX = "FANOUT_"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """Every section; each but ``server`` is defined by the part that owns it."""

    server: ServerSettings = field(default_factory=ServerSettings)
    fanout: FanOutSettings = field(default_factory=FanOutSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    mongo: MongoSettings = field(default_factory=MongoSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    lookups: Mapping[str, LookupSettings] = field(default_factory=lambda: MappingProxyType({}))
    #: Plugins' own settings sections, by panel: the keys their ``[lookups.<name>]`` adds.
    plugin_settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: The ``[backends.<name>]`` tables as written; :attr:`backends` adds the aliases.
    backend_tables: Mapping[str, BackendSettings] = field(
        default_factory=lambda: MappingProxyType({})
    )
    #: The older sections (``mongo``, ``http``) the configuration wrote keys in.
    alias_sections: tuple[str, ...] = ()
    #: The ``[callers.<name>]`` tables: callers' weights for fair share.
    callers: Mapping[str, CallerSettings] = field(default_factory=lambda: MappingProxyType({}))

    def caller_weights(self) -> dict[str, float]:
        """Each configured caller's weight, by name."""
        return {name: caller.weight for name, caller in self.callers.items()}

    @functools.cached_property
    def backends(self) -> Mapping[str, BackendSettings]:
        """Every backend by name: ``mongo``, ``alerts`` and ``metrics`` from ``[mongo]`` and
        ``[http]`` unless a ``[backends.<name>]`` table defines them, then the other tables."""
        merged: dict[str, BackendSettings] = dict(backends_from_aliases(self.mongo, self.http))
        merged.update(self.backend_tables)
        return MappingProxyType(merged)

    def backend_section(self, name: str) -> str:
        """Where backend ``name``'s keys were written: its table, or ``[mongo]`` or ``[http]``."""
        if name in self.backend_tables or name not in ALIAS_SECTIONS:
            return f"backends.{name}"
        return ALIAS_SECTIONS[name]

    def lookup(self, name: str) -> LookupSettings:
        """The policy for lookup ``name``; defaults when the config does not mention it."""
        return self.lookups.get(name) or (
            _SHIPPED_LOOKUP if name in SHIPPED_OPTIONAL else _DEFAULT_LOOKUP
        )

    def task_timeout_ms(self, name: str) -> int:
        return self.lookup(name).timeout_ms or self.fanout.task_timeout_ms


_BACKEND_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def _longest_first(sections: Iterable[type]) -> list[str]:
    # Longest first: "read_timeout_ms" must not be read as "timeout_ms" of a table "x_read".
    return sorted(
        {key.name for section in sections for key in keys_of(section)}, key=len, reverse=True
    )


#: The keys an env variable of each table is split on, longest first.
_TABLE_KEYS = {
    "backends": _longest_first(BACKEND_KINDS.values()),
    "lookups": _longest_first([LookupSettings]),
    "callers": _longest_first([CallerSettings]),
}

#: Built once: Settings.lookup runs for every panel of every call.
_DEFAULT_LOOKUP, _SHIPPED_LOOKUP = LookupSettings(), LookupSettings(optional=True)

_SECTIONS: dict[str, type] = {
    "server": ServerSettings,
    "fanout": FanOutSettings,
    "admission": AdmissionSettings,
    "mongo": MongoSettings,
    "http": HttpSettings,
    "tracing": TracingSettings,
    "metrics": MetricsSettings,
    "logging": LoggingSettings,
    "cache": CacheSettings,
}


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build and validate :class:`Settings`.

    ``overrides`` maps dotted keys (``"server.port"``) to values from flags;
    ``None`` values are ignored. Raises :class:`ConfigError` naming the bad key.
    """
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        _merge(raw, _read_toml(Path(path)))
    plugins = PluginSections(raw)
    _merge_env(raw, os.environ if env is None else env, plugins)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            section, _, key = dotted.rpartition(".")
            _merge(raw, _nest(section.split("."), key, value))
    return _build(raw, plugins)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _nest(sections: list[str], key: str, value: Any) -> dict[str, Any]:
    return {sections[0]: _nest(sections[1:], key, value)} if sections else {key: value}


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _merge_env(raw: dict[str, Any], env: Mapping[str, str], plugins: PluginSections) -> None:
    """Merge ``FANOUT_SECTION_KEY`` and ``FANOUT_<TABLES>_<NAME>_<KEY>`` variables into
    ``raw``; values stay strings until validation. A lookup's key that only its plugin
    declares is read last, once every ``factory`` is known."""
    plugin_keys = []
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        table = next((t for t in _TABLE_KEYS if rest.startswith(t + "_")), None)
        if table is not None:
            body = rest[len(table) + 1 :]
            nested = _table_variable(
                name, table, body, value, _TABLE_KEYS[table], required=table == "backends"
            )
            if nested is None:
                plugin_keys.append((name, body, value))
            else:
                _merge(raw, nested)
            continue
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            # Not ours: Kubernetes injects FANOUT_SERVICE_HOST, FANOUT_PORT_9090_TCP, ... for
            # a Service named "fanout". A misspelled key of a known section is still an error.
            log.debug("ignoring environment variable %s: names no settings section", name)
            continue
        _merge(raw, _nest([section], rest[len(section) + 1 :], value))
    if plugin_keys:
        keys = _longest_first(plugins.all())
        for name, body, value in plugin_keys:
            found = _table_variable(name, "lookups", body, value, keys, required=True)
            if found is not None:  # required: None never comes back, an error is raised
                _merge(raw, found)


class PluginSections:
    """The settings sections lookup plugins declare (``lookups.plugins.with_settings``),
    found only when a key needs one: finding one imports the plugin."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self._raw = raw  # the file's tables, then the environment's, as they are merged

    @property
    def _plugins(self) -> Any:
        # Imported when needed: the plugins module loads every lookup, and with them pymongo.
        from lookups import plugins

        return plugins

    def section(self, name: str, factory_path: str) -> type | None:
        """The section of panel ``name``'s plugin (``factory_path``, else its entry point)."""
        with as_config_error():
            factory = self._plugins.find_factory(name, factory_path)
        return self._plugins.settings_of(factory) if factory is not None else None

    def all(self) -> list[type]:
        """Every section declared by an installed entry point or a ``factory`` set so far."""
        tables = self._raw.get("lookups", {})
        paths = {
            name: body.get("factory", "")
            for name, body in tables.items()
            if isinstance(body, Mapping) and body.get("factory")
        }
        with as_config_error():
            factories = [self._plugins.find_factory(name, path) for name, path in paths.items()]
            factories += [factory for _, factory in self._plugins.entry_point_factories()]
        return [
            section for section in map(self._plugins.settings_of, factories) if section is not None
        ]


def _table_variable(
    variable: str, table: str, body: str, value: str, keys: list[str], required: bool = False
) -> dict[str, Any] | None:
    """``FANOUT_<TABLE>_<NAME>_<KEY>`` split on one of ``keys``; ``None`` if none fits,
    unless ``required``: then :class:`ConfigError`."""
    key = next((k for k in keys if body.endswith("_" + k)), None)
    if key is not None:
        return _nest([table, body[: -len(key) - 1]], key, value)
    if required:
        raise ConfigError(
            f"{variable}: expected FANOUT_{table.upper()}_<NAME>_<KEY>, "
            f"KEY one of {', '.join(sorted(keys))}"
        )
    return None


def _build(raw: Mapping[str, Any], plugins: PluginSections) -> Settings:
    unknown = set(raw) - set(_SECTIONS) - {"lookups", "backends", "callers"}
    if unknown:
        first = sorted(unknown)[0]
        known = [*_SECTIONS, "lookups", "backends", "callers"]
        near = difflib.get_close_matches(first, known, n=1)
        hint = f"; did you mean [{near[0]}]?" if near else f"; expected one of {', '.join(known)}"
        raise ConfigError(f"{first}: unknown section{hint}")
    parts = {name: build_section(name, cls, raw.get(name, {})) for name, cls in _SECTIONS.items()}
    lookups_raw = raw.get("lookups", {})
    if not isinstance(lookups_raw, Mapping):
        raise ConfigError("lookups: must be a table of [lookups.<name>] sections")
    lookups, options = {}, {}
    for name, body in lookups_raw.items():
        lookups[name], own = _lookup_table(name, body, plugins)
        if own is not None:
            options[name] = own
    return Settings(
        **parts,
        lookups=MappingProxyType(lookups),
        plugin_settings=MappingProxyType(options),
        backend_tables=MappingProxyType(_build_backends(raw.get("backends", {}))),
        alias_sections=tuple(
            name for name in dict.fromkeys(ALIAS_SECTIONS.values()) if raw.get(name)
        ),
        callers=MappingProxyType(_build_callers(raw.get("callers", {}))),
    )


def _lookup_table(name: str, body: Any, plugins: PluginSections) -> tuple[LookupSettings, Any]:
    """``[lookups.<name>]``: the keys every lookup has, and those its plugin declares."""
    label = f"lookups.{name}"
    if not isinstance(body, Mapping):
        raise ConfigError(f"{label}: must be a table")
    common = {key.name for key in keys_of(LookupSettings)}
    own = {key: value for key, value in body.items() if key not in common}
    shipped = {"optional": True} if name in SHIPPED_OPTIONAL else {}
    policy = build_section(
        label, LookupSettings, {**shipped, **{k: v for k, v in body.items() if k in common}}
    )
    if not own:
        return policy, None
    section = plugins.section(name, policy.factory)
    if section is None:
        # No plugin declares them: the first unknown key, against the keys every lookup has.
        build_section(label, LookupSettings, body)
        raise ConfigError(f"{label}: no plugin declares {', '.join(sorted(own))}")
    return policy, build_section(label, section, own)


def _build_backends(raw: Any) -> dict[str, BackendSettings]:
    """``[backends.<name>]`` tables, each validated as its ``kind`` says."""
    if not isinstance(raw, Mapping):
        raise ConfigError("backends: must be a table of [backends.<name>] sections")
    built = {}
    for name, body in raw.items():
        if not _BACKEND_NAME.fullmatch(name):
            raise ConfigError(f"backends.{name}: a backend name is letters, digits and _")
        kind = body.get("kind") if isinstance(body, Mapping) else None
        kinds = ", ".join(repr(k) for k in BACKEND_KINDS)
        if kind is None:
            raise ConfigError(f"backends.{name}.kind: missing; set it to one of {kinds}")
        if kind not in BACKEND_KINDS:
            raise ConfigError(f"backends.{name}.kind: must be one of {kinds}, got {kind!r}")
        built[name] = build_section(f"backends.{name}", BACKEND_KINDS[str(kind)], body)
    return built


def _build_callers(raw: Any) -> dict[str, CallerSettings]:
    """``[callers.<name>]`` tables, named as callers are (``RequestMeta.caller``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError("callers: must be a table of [callers.<name>] sections")
    built = {}
    for name, body in raw.items():
        if not CALLER_PATTERN.fullmatch(name):
            raise ConfigError(f"callers.{name[:64]}: {CALLER_RULE}")
        built[name] = build_section(f"callers.{name}", CallerSettings, body)
    return built
