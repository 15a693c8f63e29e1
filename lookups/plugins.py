"""Lookups from outside this package: entry points and import paths named in config.

A team adds a panel without editing Fanout, in either of two ways:

* an installed distribution declares an entry point in the ``fanout.lookups``
  group, named for the panel, whose object is a factory::

      [project.entry-points."fanout.lookups"]
      slow_queries = "acme_panels:build_slow_queries"

* the configuration names the factory by import path::

      [lookups.slow_queries]
      factory = "acme_panels:build_slow_queries"

A factory takes the process's :class:`~lookups.backends.collection.Backends` and
returns a :class:`~lookups.base.Lookup` whose ``name`` is the panel's, built on the
backend it calls: a ``[backends.<name>]`` table of its own gives it a pool, a
breaker, a health check and a pool report (``backends.http("slow_jobs")``). Panels from entry
points follow the built-in ones in name order, then those from config. A panel
name may be registered once; a factory that cannot be imported or is not
callable stops start-up with a :class:`PluginError` naming it.

A plugin may add keys to its ``[lookups.<name>]`` table by declaring a settings
section (a frozen dataclass, declared as ``service/settings/declarations.py`` describes) with
:func:`with_settings`; its factory then also receives the validated section::

    @with_settings(SlowUrlsSettings)
    def build(backends, settings):
        return SlowUrlsLookup(backends.mongo("reports"), settings.min_count)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any

from lookups.registry import LookupFactory, LookupRegistry, settings_of, with_settings

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginError",
    "add_entry_points",
    "add_configured",
    "load_factory",
    "with_settings",
    "settings_of",
    "find_factory",
    "entry_point_factories",
]

ENTRY_POINT_GROUP = "fanout.lookups"


class PluginError(ValueError):
    """A lookup plugin cannot be loaded; the message names it and why."""


def add_entry_points(registry: LookupRegistry) -> list[str]:
    """Register every ``fanout.lookups`` entry point installed; return their panel names."""
    added = []
    for name, factory in entry_point_factories():
        _register(registry, name, factory)
        added.append(name)
    return added


def entry_point_factories(only: str | None = None) -> Iterator[tuple[str, LookupFactory]]:
    """The installed ``fanout.lookups`` factories (or the one named ``only``), loaded, by name."""
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        if only is not None and point.name != only:
            continue
        try:
            factory = point.load()
        except Exception as exc:  # any import failure is the plugin's
            raise PluginError(
                f"entry point {point.name} = {point.value!r} ({ENTRY_POINT_GROUP}): "
                f"cannot load it: {type(exc).__name__}: {exc}"
            ) from exc
        yield point.name, _callable(factory, f"entry point {point.name}")


def find_factory(name: str, path: str = "") -> LookupFactory | None:
    """The factory of panel ``name``: the one ``path`` names, else its entry point, if any."""
    if path:
        return load_factory(path, f"lookups.{name}.factory")
    return next((factory for _, factory in entry_point_factories(only=name)), None)


def add_configured(registry: LookupRegistry, factories: Mapping[str, str]) -> None:
    """Register the factory each panel's ``lookups.<name>.factory`` names (``module:attribute``)."""
    for name, path in factories.items():
        _register(registry, name, load_factory(path, f"lookups.{name}.factory"))


def load_factory(path: str, key: str) -> LookupFactory:
    """Import ``module:attribute`` (the attribute may be dotted); ``key`` names it in errors."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise PluginError(f"{key}: expected 'module:attribute', got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{key}: cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    return _callable(target, key)


def _callable(factory: Any, key: str) -> LookupFactory:
    if not callable(factory):
        raise PluginError(
            f"{key}: {factory!r} is not callable; a factory takes the backend "
            "clients and returns a Lookup"
        )
    checked: LookupFactory = factory
    return checked


def _register(registry: LookupRegistry, name: str, factory: LookupFactory) -> None:
    try:
        registry.register(name, factory)
    except ValueError as exc:
        raise PluginError(f"lookup plugin {name!r}: {exc}") from exc
