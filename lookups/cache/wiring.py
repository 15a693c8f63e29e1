"""How a server puts the results cache in front of its lookups: the store it opens
(:func:`open_store`), and each MongoDB panel made of parts, and the alerts panel, answered
through it (:func:`with_cache`)."""

from __future__ import annotations

from collections.abc import Mapping

from lookups.base import Lookup
from lookups.cache.alerts import CachedAlerts
from lookups.cache.cached import CachedLookup
from lookups.cache.merged import MergedRuns
from lookups.cache.plans import PlanChooser
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import BucketStore, CacheStats, MemoryStore, RedisStore
from lookups.clock import Clock
from lookups.http import AlertsLookup
from lookups.mongo import MongoLookup
from lookups.mongo_parts import parts_of

__all__ = ["with_cache", "open_store"]


def with_cache(
    lookups: Mapping[str, Lookup], settings: CacheSettings, store: BucketStore
) -> dict[str, Lookup]:
    """``lookups`` with each MongoDB panel that is made of parts, and the alerts panel,
    answered through ``store``; the others as they are."""
    cached: dict[str, Lookup] = {}
    merged = MergedRuns(settings.max_bytes // 8, store.stats)
    for name, lookup in lookups.items():
        if type(lookup) is AlertsLookup:
            service = lookup.backend
            cached[name] = CachedAlerts(
                lookup, store, settings, f"{service.name}/{service.settings.url}", service.clock
            )
            continue
        parts = parts_of(lookup)
        if parts is None or not isinstance(lookup, MongoLookup):
            cached[name] = lookup  # only MongoDB lookups have parts
            continue
        backend = lookup.backend
        namespace = f"{backend.name}/{backend.settings.database}"
        chooser = None
        if settings.plan == "measured":
            chooser = PlanChooser(
                settings.replan_ms / 1000, backend.engine_use, store.stats, backend.clock
            )
        cached[name] = CachedLookup(
            lookup, parts, store, settings, namespace, merged, chooser, backend.clock
        )
    return cached


def open_store(settings: CacheSettings, clock: Clock) -> BucketStore:
    """Redis when ``cache.url`` names one (its outages timed on ``clock``, the service's),
    else this process's memory, counting into a new :class:`CacheStats`. In this process
    the buckets get seven eighths of ``max_bytes``, and the sums of whole runs of buckets
    (:func:`with_cache`) the last eighth."""
    if settings.url:
        return RedisStore(
            settings.url, settings.redis_timeout_ms, settings.ttl_s, CacheStats(), clock=clock
        )
    return MemoryStore(settings.max_bytes - settings.max_bytes // 8, CacheStats())
