"""The lookup registry: panel names mapped to factories that build lookups on the backends.

A new panel is one :meth:`LookupRegistry.register` call with a factory taking the
:class:`~lookups.backends.collection.Backends`; the fan-out engine and the handler need
no change. Its backend is a ``[backends.<name>]`` table of the configuration::

    registry = default_registry()
    registry.register("slow_jobs", lambda backends: SlowJobsLookup(backends.http("slow_jobs")))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lookups.backends.collection import Backends
from lookups.base import Lookup
from lookups.http import AlertsLookup, LatencyLookup, VolumeLookup
from lookups.mongo import ControllersLookup, ErrorsLookup, QueriesLookup, UrlsLookup

__all__ = ["LookupFactory", "LookupRegistry", "default_registry", "with_settings", "settings_of"]

#: Takes the backends, and the lookup's own settings if it declares them (:func:`with_settings`).
LookupFactory = Callable[..., Lookup]


def with_settings(section: type) -> Callable[[Any], Any]:
    """Declare that a factory's lookup has settings of its own, in ``section`` (a frozen
    dataclass declared as ``service/settings/declarations.py`` says): keys of its
    ``[lookups.<name>]`` table, validated like every other key and handed to the factory
    as its second argument."""

    def declare(factory: Any) -> Any:
        factory.settings = section
        return factory

    return declare


def settings_of(factory: Any) -> type | None:
    """The settings section ``factory`` declares with :func:`with_settings`, or ``None``."""
    section = getattr(factory, "settings", None)
    return section if isinstance(section, type) else None


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

    def build(
        self, backends: Backends, plugin_settings: Mapping[str, Any] = MappingProxyType({})
    ) -> dict[str, Lookup]:
        """One lookup per registered name, in registration order, sharing ``backends``.

        A factory that declares settings (:func:`with_settings`) also gets its lookup's,
        from ``plugin_settings`` (validated by the configuration), else the section's defaults.

        Raises :class:`ValueError` if a factory returns a lookup whose ``name`` differs
        from the name it was registered under (the panel would be reported twice), or asks
        for a backend that is not configured.
        """
        lookups: dict[str, Lookup] = {}
        for name, factory in self._factories.items():
            try:
                section = settings_of(factory)
                lookup = (
                    factory(backends)
                    if section is None
                    else factory(backends, plugin_settings.get(name) or section())
                )
            except KeyError as exc:
                raise ValueError(f"lookup {name!r}: {exc.args[0] if exc.args else exc}") from None
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
    for mongo in (ErrorsLookup, UrlsLookup, ControllersLookup, QueriesLookup):
        registry.register(mongo.name, lambda b, cls=mongo: cls(b.mongo(cls.backend_name)))
    for http in (AlertsLookup, LatencyLookup, VolumeLookup):
        registry.register(http.name, lambda b, cls=http: cls(b.http(cls.backend_name)))
    return registry
