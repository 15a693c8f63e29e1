"""The lookup registry: panel names mapped to factories that build lookups from the clients.

A new panel is one :meth:`LookupRegistry.register` call with a factory; the fan-out
engine and the handler need no change::

    registry = default_registry()
    registry.register("slow_jobs", lambda backends: SlowJobsLookup(backends.db))
"""

from __future__ import annotations

from typing import Callable

from lookups.base import Lookup
from lookups.clients import BackendClients
from lookups.http import AlertsLookup, LatencyLookup, VolumeLookup
from lookups.mongo import ControllersLookup, ErrorsLookup, QueriesLookup, UrlsLookup

__all__ = ["LookupFactory", "LookupRegistry", "default_registry"]

LookupFactory = Callable[[BackendClients], Lookup]


class LookupRegistry:
    """Ordered panel names and the factories that build their lookups."""

    def __init__(self) -> None:
        self._factories: dict[str, LookupFactory] = {}

    def register(self, name: str, factory: LookupFactory) -> None:
        """Add panel ``name``. Raises :class:`ValueError` if the name is empty or taken."""
        if not name:
            raise ValueError("a lookup needs a non-empty name")
        if name in self._factories:
            raise ValueError(f"lookup {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> tuple[str, ...]:
        """Registered panel names, in registration order."""
        return tuple(self._factories)

    def build(self, backends: BackendClients) -> dict[str, Lookup]:
        """One lookup per registered name, in registration order, sharing ``backends``.

        Raises :class:`ValueError` if a factory returns a lookup whose ``name`` differs
        from the name it was registered under (the panel would be reported twice).
        """
        lookups: dict[str, Lookup] = {}
        for name, factory in self._factories.items():
            lookup = factory(backends)
            if lookup.name != name:
                raise ValueError(f"factory for {name!r} built a lookup named {lookup.name!r}")
            lookups[name] = lookup
        return lookups

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __repr__(self) -> str:
        return f"<LookupRegistry {', '.join(self._factories)}>"


def default_registry() -> LookupRegistry:
    """The seven dashboard panels: errors, urls, controllers, queries, alerts, latency, volume."""
    registry = LookupRegistry()
    registry.register("errors", lambda b: ErrorsLookup(b.db, b.mongo_slots, b.guards.mongo))
    registry.register("urls", lambda b: UrlsLookup(b.db, b.mongo_slots, b.guards.mongo))
    registry.register("controllers", lambda b: ControllersLookup(b.db, b.mongo_slots, b.guards.mongo))
    registry.register("queries", lambda b: QueriesLookup(b.db, b.mongo_slots, b.guards.mongo))
    for name, lookup in (("alerts", AlertsLookup), ("latency", LatencyLookup),
                         ("volume", VolumeLookup)):
        registry.register(name, lambda b, lookup=lookup: lookup(b.session, b.http_settings,
                                                                b.http_slots, b.guards))
    return registry
