"""Settings declared once: a section is a frozen dataclass, and each field is one key.

A field declares everything about its key in the standard ``dataclasses.field``
metadata, so a section's owner, or a plugin, declares one with nothing of ours::

    @dataclass(frozen=True)
    class FanOutSettings:
        pool_size: int = field(default=16, metadata={
            "help": "tasks of one request running at once", "min": 1})

The annotation is the key's type: ``bool``, ``int``, ``float``, ``str`` or
``tuple[str, ...]`` (a TOML array, or one string with commas in an environment
variable). The metadata keys:

=========== ===================================================================
``help``    required: what the key means, in Markdown (the manual's tables show it)
``min``     an ``int``'s or ``float``'s least value; every ``int`` declares one
``max``     its greatest value, if it has one
``choices`` the values a ``str`` may take
``auto``    an ``int`` that also takes ``"auto"``: a function giving its value
=========== ===================================================================

A declaration that breaks these rules raises :class:`TypeError` the first time
its section is read. Rules between keys stay in the section's ``__post_init__``,
which raises :class:`ValueError` naming the key. From the declarations come the
validation here, the environment variables (``service/settings/config.py``) and the
manual's tables (``service/cli/settings_table.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from service.errors import ConfigError

__all__ = ["Key", "keys_of", "build_section", "as_config_error"]

_METADATA = frozenset({"help", "min", "max", "choices", "auto"})
_TYPES = {bool: "bool", int: "int", float: "float", str: "str", tuple[str, ...]: "names"}


@dataclass(frozen=True)
class Key:
    """One declared key of a section: its name, type, default and rules."""

    name: str
    kind: str  # bool | int | float | str | names
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    auto: Callable[[], int] | None = None


@functools.cache
def keys_of(section: type) -> tuple[Key, ...]:
    """The declared keys of ``section``, in order; :class:`TypeError` if one is ill-declared."""
    hints = typing.get_type_hints(section)
    return tuple(_key(section, field, hints[field.name]) for field in dataclasses.fields(section))


def _key(section: type, field: dataclasses.Field[Any], annotation: Any) -> Key:
    where = f"{section.__name__}.{field.name}"
    meta = dict(field.metadata)
    kind = _TYPES.get(annotation)
    if kind is None:
        raise TypeError(
            f"{where}: a setting is bool, int, float, str or tuple[str, ...], not {annotation!r}"
        )
    if set(meta) - _METADATA or not meta.get("help"):
        raise TypeError(
            f"{where}: metadata needs 'help' and may add only "
            f"{', '.join(sorted(_METADATA - {'help'}))}; got {sorted(meta)}"
        )
    if kind == "int" and "min" not in meta:
        raise TypeError(f"{where}: an int setting declares its 'min'")
    if ("min" in meta or "max" in meta) and kind not in ("int", "float"):
        raise TypeError(f"{where}: only numbers have 'min' and 'max'")
    if ("choices" in meta and kind != "str") or ("auto" in meta and kind != "int"):
        raise TypeError(f"{where}: 'choices' is for a str, 'auto' for an int")
    default = field.default
    if default is dataclasses.MISSING:
        raise TypeError(f"{where}: a setting has a default")
    return Key(
        field.name,
        kind,
        default,
        meta["help"],
        meta.get("min"),
        meta.get("max"),
        tuple(meta["choices"]) if "choices" in meta else None,
        meta.get("auto"),
    )


def build_section(label: str, section: type, body: Any) -> Any:
    """``section`` built from ``body``, the raw table; :class:`ConfigError` naming the key.

    ``label`` is the section's place in the configuration (``"fanout"``,
    ``"lookups.errors"``): errors read ``fanout.pool_size: must be ...``.
    """
    if not isinstance(body, Mapping):
        raise ConfigError(f"{label}: must be a table")
    keys = {key.name: key for key in keys_of(section)}
    values = {}
    for name, value in body.items():
        if name not in keys:
            raise ConfigError(f"{label}.{name}: unknown key; expected one of {', '.join(keys)}")
        values[name] = coerce(f"{label}.{name}", keys[name], value)
    with as_config_error(label):
        return section(**values)


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


def coerce(label: str, key: Key, value: Any) -> Any:
    """``value`` as ``key`` declares it; :class:`ConfigError` starting with ``label``."""
    if key.kind == "bool":
        return _to_bool(label, value)
    if key.kind == "int":
        if key.auto is not None and isinstance(value, str) and value.strip().lower() == "auto":
            return key.auto()
        return _in_bounds(label, key, _to_int(label, value), "an integer")
    if key.kind == "float":
        return _in_bounds(label, key, _to_float(label, value), "a number")
    if key.kind == "names":
        return _to_names(label, value)
    if not isinstance(value, str):
        raise ConfigError(f"{label}: must be a string, got {value!r}")
    result = value.strip()
    if key.choices is not None and result not in key.choices:
        listed = ", ".join(repr(c) for c in key.choices if c)
        raise ConfigError(f"{label}: must be one of {listed}, got {value!r}")
    return result


def _in_bounds(label: str, key: Key, number: Any, what: str) -> Any:
    low, high = key.min, key.max
    if (low is not None and number < low) or (high is not None and number > high):
        bound = (
            f">= {low}"
            if high is None
            else f"<= {high}"
            if low is None
            else f"between {low} and {high}"
        )
        raise ConfigError(f"{label}: must be {what} {bound}, got {number!r}")
    return number


def _to_bool(label: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{label}: must be true or false, got {value!r}")


def _to_int(label: str, value: Any) -> int:
    try:
        if isinstance(value, (bool, float)):
            raise ValueError
        return int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: must be an integer, got {value!r}") from None


def _to_float(label: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{label}: must be a number, got {value!r}") from None


def _to_names(label: str, value: Any) -> tuple[str, ...]:
    """A list of non-empty strings: a TOML array, or one string separated by commas (env)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{label}: must be a list of strings, got {value!r}")
    names = tuple(item.strip() for item in items if item.strip())
    if isinstance(value, list) and len(names) != len(value):
        raise ConfigError(f"{label}: must not hold empty strings, got {value!r}")
    return names
