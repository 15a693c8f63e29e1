"""The manual's tables of settings, made from the sections' declarations.

A page of the manual holds ``<!-- settings:NAME -->`` where table NAME goes, and the
manual's build fills it in (``docs/_generate/hooks.py``), so a table never differs
from the declarations.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from lookups.backends.settings import BACKEND_KINDS
from lookups.cache.settings import CacheSettings
from lookups.settings import HttpSettings, LookupSettings, MongoSettings
from service.engine.settings import AdmissionSettings, CallerSettings, FanOutSettings
from service.operations.logs import LoggingSettings
from service.settings.declarations import Key, keys_of
from service.settings.server import ServerSettings
from tracing.settings import MetricsSettings, TracingSettings

__all__ = ["tables"]

#: Which sections each table shows, under which key prefix.
_TABLES: dict[str, Sequence[tuple[str, type]]] = {
    "config": (
        ("server", ServerSettings),
        ("fanout", FanOutSettings),
        ("admission", AdmissionSettings),
        ("callers.<name>", CallerSettings),
        ("lookups.<name>", LookupSettings),
        ("logging", LoggingSettings),
    ),
    "aliases": (("mongo", MongoSettings), ("http", HttpSettings)),
    "tracing": (("tracing", TracingSettings),),
    "metrics": (("metrics", MetricsSettings),),
    "cache": (("cache", CacheSettings),),
}


def tables() -> dict[str, str]:
    """Every table, in Markdown, by block name."""
    made = {name: _section_table(sections) for name, sections in _TABLES.items()}
    made["backends"] = _backends_table()
    return made


def _section_table(sections: Iterable[tuple[str, type]]) -> str:
    lines = ["| key | values | default | meaning |", "| --- | --- | --- | --- |"]
    for prefix, section in sections:
        for key in _own_keys_first(section):
            lines.append(
                f"| `{prefix}.{key.name}` | {_values(key)} | {_default(key)} | {key.help} |"
            )
    return "\n".join(lines) + "\n"


def _backends_table() -> str:
    """One row per key of a ``[backends.<name>]`` table, saying which kinds have it."""
    rows: dict[str, list[tuple[str, Key]]] = {}
    for kind, section in BACKEND_KINDS.items():
        for key in _own_keys_first(section):
            rows.setdefault(key.name, []).append((kind, key))
    lines = ["| key | kinds | values | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, kinds in rows.items():
        first = kinds[0][1]
        if name == "kind":
            values, default = ", ".join(f"`{k}`" for k in BACKEND_KINDS), "(required)"
        else:
            values = _values(first)
            defaults = {_default(key) for _, key in kinds}
            default = (
                _default(first)
                if len(defaults) == 1
                else ", ".join(f"{_default(key)} {kind}" for kind, key in kinds)
            )
        which = "both" if len(kinds) == len(BACKEND_KINDS) else kinds[0][0]
        lines.append(f"| `{name}` | {which} | {values} | {default} | {first.help} |")
    return "\n".join(lines) + "\n"


def _own_keys_first(section: type) -> list[Key]:
    """The keys of ``section`` itself, then those of its bases (retries, breaker: last)."""
    own = inspect.get_annotations(section)
    keys = keys_of(section)
    return [k for k in keys if k.name in own] + [k for k in keys if k.name not in own]


def _values(key: Key) -> str:
    if key.kind == "bool":
        return "`true`, `false`"
    if key.kind == "names":
        return "list of strings"
    if key.kind == "str":
        if key.choices is None:
            return "string"
        return ", ".join(f"`{c}`" if c else "empty" for c in key.choices)
    what = "integer" if key.kind == "int" else "number"
    if key.min is not None and key.max is not None:
        bounds = f" {key.min} to {key.max}"
    elif key.min is not None:
        bounds = f" ≥ {key.min}"
    elif key.max is not None:
        bounds = f" ≤ {key.max}"
    else:
        bounds = ""
    return what + bounds + (', or `"auto"`' if key.auto is not None else "")


def _default(key: Key) -> str:
    value: Any = key.default
    if value in ("", ()):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"
