"""Validated settings: one immutable value built from a TOML file, env vars and flags.

Precedence, lowest to highest: built-in defaults, the TOML file (``--config``),
``FANOUT_<SECTION>_<KEY>`` environment variables, command-line flags. Lookup
sections use ``FANOUT_LOOKUPS_<NAME>_<KEY>`` (for example
``FANOUT_LOOKUPS_ERRORS_REQUIRED=true``). A ``FANOUT_`` variable naming no
section (the service links Kubernetes injects) is ignored, with a debug line;
an unknown key in a known section, or anything unknown in the file, is an error.

Every value is checked once, at start-up; a bad one raises :class:`ConfigError`
naming the key (``fanout.pool_size: must be an integer >= 1, got 'many'``).
Nothing below the handler reads configuration: each part receives its section.

Each section is defined by the part that owns it, with its per-key rules::

    [server]          ServerSettings    here: the listener is the service's own
    [fanout]          FanOutSettings    service/engine/settings.py
    [admission]       AdmissionSettings service/engine/settings.py
    [mongo] [http]    MongoSettings, HttpSettings    lookups/settings.py
    [lookups.<name>]  LookupSettings    lookups/settings.py
    [tracing]         TracingSettings   tracing/settings.py
    [metrics]         MetricsSettings   tracing/settings.py
    [logging]         LoggingSettings   service/logs.py

This module loads, merges, coerces and composes them into :class:`Settings`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Iterator, Mapping, Optional

from lookups.backends.settings import BACKEND_KINDS, BackendSettings, backends_from_aliases
from lookups.settings import HttpSettings, LookupSettings, MongoSettings
from service.errors import ConfigError
from service.wire.formats import PROTOCOLS, TRANSPORTS
from service.engine.settings import AdmissionSettings, FanOutSettings
from service.logs import LoggingSettings
from tracing.settings import MetricsSettings, TracingSettings

__all__ = ["ConfigError", "ServerSettings", "Settings", "load_settings", "pool_warnings",
           "as_config_error"]

ENV_PREFIX = "FANOUT_"

log = logging.getLogger(__name__)


def _usable_cores() -> int:
    # Imported when called: service.workers imports this module.
    from service.workers.process import usable_cores

    return usable_cores()


@dataclass(frozen=True)
class ServerSettings:
    """The Thrift listener: address, wire format, connection and message limits, drain."""

    host: str = "127.0.0.1"
    port: int = 9090
    transport: str = "framed"          # framed | buffered
    protocol: str = "binary"           # binary | compact
    strict_binary: bool = False        # true: refuse old-style binary messages (no version header)
    max_connections: int = 1000
    max_frame_bytes: int = 1024 * 1024
    idle_timeout_ms: int = 60_000      # a connection idle between calls is closed
    frame_timeout_ms: int = 5_000      # once a message has begun, all of it must arrive within this
    max_string_bytes: int = 64 * 1024  # any one string or binary field inside a message
    max_container_items: int = 10_000  # any one list, set or map inside a message
    max_nesting_depth: int = 32        # structs and containers within each other
    drain_timeout_ms: int = 10_000     # on SIGTERM/SIGINT: how long calls in flight may finish
    tls_cert_file: str = ""            # both set: the Thrift listener speaks TLS
    tls_key_file: str = ""
    tls_client_ca_file: str = ""       # set: clients must present a certificate signed by these CAs
    tls_client_names: tuple[str, ...] = ()  # set: ...naming one of these (DNS or URI SAN)
    workers: int = 1                   # > 1: pre-forked worker processes sharing the port; "auto": one per core
    hub_block_threshold_ms: int = 100  # report event-loop iterations longer than this; 0 = off
    lame_duck_ms: int = 0              # on SIGTERM: report DRAINING, still serving, this long first
    max_connection_age_ms: int = 0     # > 0: close a connection after a call once it is this old
    probe_port: int = -1               # >= 0: HTTP /healthz and /readyz here (0: any free port)
    probe_host: str = ""               # where the probes listen; empty: server.host
    worker_heartbeat_timeout_ms: int = 30_000  # a worker silent this long is killed; 0 = never

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType(
        {"transport": TRANSPORTS, "protocol": PROTOCOLS})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType({
        "port": (0, 65535), "workers": (1, 64), "hub_block_threshold_ms": (0, None),
        "drain_timeout_ms": (0, None), "max_frame_bytes": (64, 64 * 1024 * 1024),
        "lame_duck_ms": (0, None), "max_connection_age_ms": (0, None), "probe_port": (-1, 65535),
        "worker_heartbeat_timeout_ms": (0, None),
        "max_string_bytes": (16, None)})
    #: Integer keys that also take "auto", and what it means.
    AUTO_INTS: ClassVar[Mapping[str, Callable[[], int]]] = MappingProxyType({"workers": _usable_cores})

    @property
    def probe_bind_host(self) -> str:
        """Where the probes listen: ``probe_host``, else ``host``."""
        return self.probe_host or self.host

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file: needs tls_cert_file and tls_key_file "
                             "(mutual TLS is TLS first)")
        if self.tls_client_names and not self.tls_client_ca_file:
            raise ValueError("tls_client_names: needs tls_client_ca_file (names are checked "
                             "on verified client certificates only)")
        if self.max_string_bytes > self.max_frame_bytes:
            raise ValueError(f"max_string_bytes: must be at most server.max_frame_bytes "
                             f"({self.max_frame_bytes}), got {self.max_string_bytes}")


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
    lookups: Mapping[str, LookupSettings] = field(default_factory=lambda: MappingProxyType({}))
    #: The ``[backends.<name>]`` tables as written; :attr:`backends` adds the aliases.
    backend_tables: Mapping[str, BackendSettings] = field(default_factory=lambda: MappingProxyType({}))

    @functools.cached_property
    def backends(self) -> Mapping[str, BackendSettings]:
        """Every backend by name: ``mongo``, ``alerts`` and ``metrics`` from ``[mongo]`` and
        ``[http]`` unless a ``[backends.<name>]`` table defines them, then the other tables."""
        merged: dict[str, BackendSettings] = dict(backends_from_aliases(self.mongo, self.http))
        merged.update(self.backend_tables)
        return MappingProxyType(merged)

    def lookup(self, name: str) -> LookupSettings:
        """The policy for lookup ``name``; defaults when the config does not mention it."""
        return self.lookups.get(name, _DEFAULT_LOOKUP)

    def task_timeout_ms(self, name: str) -> int:
        return self.lookup(name).timeout_ms or self.fanout.task_timeout_ms


_BACKEND_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# Longest first: "read_timeout_ms" must not be read as "timeout_ms" of a table "x_read".
_BACKEND_KEYS = sorted({f.name for kind in BACKEND_KINDS.values() for f in dataclasses.fields(kind)},
                       key=len, reverse=True)
_LOOKUP_KEYS = sorted((f.name for f in dataclasses.fields(LookupSettings)), key=len, reverse=True)

#: Built once: Settings.lookup runs for every panel of every call.
_DEFAULT_LOOKUP = LookupSettings()

_SECTIONS: dict[str, type] = {
    "server": ServerSettings, "fanout": FanOutSettings, "admission": AdmissionSettings,
    "mongo": MongoSettings, "http": HttpSettings, "tracing": TracingSettings,
    "metrics": MetricsSettings, "logging": LoggingSettings,
}


@contextmanager
def as_config_error(label: str = "") -> Iterator[None]:
    """Turn an owner's :class:`ValueError` about its settings into :class:`ConfigError`.

    Owners (a section's ``__post_init__``, the backend clients, tracing set-up) name
    the key relative to ``label``, the section, if one is given.
    """
    try:
        yield
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{label}.{exc}" if label else str(exc)) from None


def load_settings(path: Optional[str | Path] = None, *, env: Optional[Mapping[str, str]] = None,
                  overrides: Optional[Mapping[str, Any]] = None) -> Settings:
    """Build and validate :class:`Settings`.

    ``overrides`` maps dotted keys (``"server.port"``) to values from flags;
    ``None`` values are ignored. Raises :class:`ConfigError` naming the bad key.
    """
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        _merge(raw, _read_toml(Path(path)))
    _merge(raw, _from_env(os.environ if env is None else env))
    for dotted, value in (overrides or {}).items():
        if value is not None:
            section, _, key = dotted.rpartition(".")
            _merge(raw, _nest(section.split("."), key, value))
    return _build(raw)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _nest(sections: list[str], key: str, value: Any) -> dict[str, Any]:
    nested: dict[str, Any] = {key: value}
    for name in reversed(sections):
        nested = {name: nested}
    return nested


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Parse ``FANOUT_SECTION_KEY`` and ``FANOUT_<TABLES>_<NAME>_<KEY>`` variables; values
    stay strings until validation."""
    raw: dict[str, Any] = {}
    tables = {"backends": _BACKEND_KEYS, "lookups": _LOOKUP_KEYS}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        table = next((t for t in tables if rest.startswith(t + "_")), None)
        if table is not None:
            body = rest[len(table) + 1:]
            key = next((k for k in tables[table] if body.endswith("_" + k)), None)
            if key is None:
                raise ConfigError(f"{name}: expected FANOUT_{table.upper()}_<NAME>_<KEY>, "
                                  f"KEY one of {', '.join(sorted(tables[table]))}")
            _merge(raw, _nest([table, body[: -len(key) - 1]], key, value))
            continue
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            # Not ours: Kubernetes injects FANOUT_SERVICE_HOST, FANOUT_PORT_9090_TCP, ... for
            # a Service named "fanout". A misspelled key of a known section is still an error.
            log.debug("ignoring environment variable %s: names no settings section", name)
            continue
        _merge(raw, _nest([section], rest[len(section) + 1:], value))
    return raw


def _build(raw: Mapping[str, Any]) -> Settings:
    unknown = set(raw) - set(_SECTIONS) - {"lookups", "backends"}
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section")
    parts = {name: _build_section(name, cls, raw.get(name, {})) for name, cls in _SECTIONS.items()}
    lookups_raw = raw.get("lookups", {})
    if not isinstance(lookups_raw, Mapping):
        raise ConfigError("lookups: must be a table of [lookups.<name>] sections")
    lookups = {name: _build_section(f"lookups.{name}", LookupSettings, body)
               for name, body in lookups_raw.items()}
    return Settings(**parts, lookups=MappingProxyType(lookups),
                    backend_tables=MappingProxyType(_build_backends(raw.get("backends", {}))))


def _build_backends(raw: Any) -> dict[str, BackendSettings]:
    """``[backends.<name>]`` tables, each validated as its ``kind`` says."""
    if not isinstance(raw, Mapping):
        raise ConfigError("backends: must be a table of [backends.<name>] sections")
    built = {}
    for name, body in raw.items():
        if not _BACKEND_NAME.fullmatch(name):
            raise ConfigError(f"backends.{name}: a backend name is letters, digits and _")
        kind = body.get("kind") if isinstance(body, Mapping) else None
        if kind not in BACKEND_KINDS:
            raise ConfigError(f"backends.{name}.kind: must be one of "
                              f"{', '.join(repr(k) for k in BACKEND_KINDS)}, got {kind!r}")
        built[name] = _build_section(f"backends.{name}", BACKEND_KINDS[kind], body)
    return built


def _build_section(label: str, cls: type, body: Any) -> Any:
    if not isinstance(body, Mapping):
        raise ConfigError(f"{label}: must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in body.items():
        if key not in fields:
            raise ConfigError(f"{label}.{key}: unknown key; expected one of {', '.join(fields)}")
        values[key] = _coerce(f"{label}.{key}", cls, key, type(fields[key].default), value)
    with as_config_error(label):
        return cls(**values)


def _coerce(label: str, cls: type, key: str, kind: type, value: Any) -> Any:
    """``value`` as ``kind``, within the section's ``CHOICES``, ``INT_BOUNDS`` and
    ``AUTO_INTS`` (integer keys that also take ``"auto"``) for ``key``."""
    if kind is bool:
        return _to_bool(label, value)
    if kind is int:
        auto = getattr(cls, "AUTO_INTS", {}).get(key)
        if auto is not None and isinstance(value, str) and value.strip().lower() == "auto":
            return auto()
        return _to_int(label, value, cls.INT_BOUNDS.get(key, (1, None)))
    if kind is float:
        return _to_float(label, value)
    if kind is tuple:
        return _to_names(label, value)
    if not isinstance(value, str):
        raise ConfigError(f"{label}: must be a string, got {value!r}")
    result = value.strip()
    choices = cls.CHOICES.get(key)
    if choices is not None and result not in choices:
        listed = ", ".join(repr(c) for c in choices if c)
        raise ConfigError(f"{label}: must be one of {listed}, got {value!r}")
    return result


def _to_bool(label: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{label}: must be true or false, got {value!r}")


def _to_int(label: str, value: Any, bounds: tuple[int, Optional[int]]) -> int:
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        number = int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: must be an integer, got {value!r}") from None
    low, high = bounds
    if number < low or (high is not None and number > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{label}: must be an integer {bound}, got {value!r}")
    return number


def _to_names(label: str, value: Any) -> tuple[str, ...]:
    """A list of non-empty strings: a TOML array, or one string separated by commas (env)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{label}: must be a list of strings, got {value!r}")
    names = tuple(item.strip() for item in items if item.strip())
    if isinstance(value, list) and len(names) != len(value):
        raise ConfigError(f"{label}: must not hold empty strings, got {value!r}")
    return names


def _to_float(label: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: must be a number, got {value!r}") from None


def pool_warnings(settings: Settings) -> list[str]:
    """Mismatched pool sizes that will queue or drop work, as human-readable warnings."""
    fan = settings.fanout
    warnings = []
    short: dict[str, tuple[int, list[str]]] = {}  # key -> (size, backends): [http] is two
    for name, backend in settings.backends.items():
        if backend.pool_size < fan.pool_size:
            short.setdefault(_pool_key(settings, name), (backend.pool_size, []))[1].append(name)
    for key, (size, names) in short.items():
        warnings.append(f"{key} ({size}) < fanout.pool_size ({fan.pool_size}): parallel lookups "
                        f"of {' and '.join(names)} will wait for a connection")
    if fan.max_inflight_tasks < fan.pool_size:
        warnings.append(f"fanout.max_inflight_tasks ({fan.max_inflight_tasks}) < fanout.pool_size "
                        f"({fan.pool_size}): a single request can never use its whole pool")
    if fan.task_timeout_ms > fan.request_deadline_ms:
        warnings.append(f"fanout.task_timeout_ms ({fan.task_timeout_ms}) > "
                        f"fanout.request_deadline_ms ({fan.request_deadline_ms}): "
                        "the request deadline always cuts tasks first")
    if fan.queue_timeout_ms >= fan.request_deadline_ms:
        warnings.append(f"fanout.queue_timeout_ms ({fan.queue_timeout_ms}) >= "
                        f"fanout.request_deadline_ms ({fan.request_deadline_ms}): "
                        "queued tasks would time out before they are rejected")
    return warnings


def _pool_key(settings: Settings, name: str) -> str:
    """The key a user wrote for backend ``name``'s pool: its table's, or its alias's."""
    if name in settings.backend_tables:
        return f"backends.{name}.pool_size"
    return "mongo.max_pool_size" if name == "mongo" else "http.pool_maxsize"
