"""The series read from a running service's own parts when a reader collects.

One registry: the services alive in this process (a server runs one; tests run
several), each by its :class:`~service.operations.snapshot.ServiceParts`. A collection
takes one :class:`~service.operations.snapshot.ServiceSnapshot` of each, and every
instrument reads its series from those: the pools, each backend's circuit, attempts
and last health check, admission, the gate, the engine, coalescing and the cache.
Nothing is paid on the hot path; nothing at all while no meter provider is installed.

Series (names as Prometheus shows them: ``fanout_pool_size``, ...)::

    fanout.pool.size, .in_use, .in_use_p99, .wait_p99, .recommended   by fanout.pool.name
    fanout.circuit.state (0 closed, 1 half open, 2 open), fanout.circuit.opened,
    fanout.backend.calls, .failures,
    fanout.backend.attempts, .retries, .retries_refused, .hedges      by fanout.backend
    fanout.backend.up (1 up, 0 down, as last checked)                 by fanout.backend
    fanout.admission.limit, .limit_min, .inflight, .queued
    fanout.calls.overloaded, fanout.calls.held
    fanout.calls.refused                                              by fanout.criticality
    fanout.callers.admitted, .refused, .in_flight                     by fanout.caller
    fanout.brownout.level (0 to 1, the dimmer), fanout.panels.skipped  by fanout.skip_reason
    fanout.tasks.started, .rejected, .abandoned, .killed, .coalesced
    fanout.event_loop.blocked (runs over server.hub_block_threshold_ms)
    fanout.cache.hits, .misses, .fills, .evictions, .direct, .query_windows, .timings,
    .timings_failed, .timings_crowded, .timings_running, .redis_errors
    fanout.cache.bytes (what this process holds: buckets' keys and values, kept sums)
    fanout.cache.store_up (1, or 0 while Redis is down)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from lookups.resilience.breaker import CircuitState
from service.operations.snapshot import BackendSnapshot, ServiceParts, ServiceSnapshot, take

__all__ = ["observe"]

_STATE_VALUE = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}
_Callback = Callable[[CallbackOptions], Iterable[Observation]]


def observe(parts: ServiceParts) -> None:
    """Publish the series of a service's ``parts`` while they are alive."""
    _collection.services.add(parts)


class _Collection:
    """One snapshot of each live service per collection, shared by every instrument.

    A collection calls each instrument's callback once: an instrument asking again means a
    new collection, and the snapshots are taken anew. That holds whatever order the SDK
    calls the callbacks in, and for several readers collecting in turn.
    """

    def __init__(self) -> None:
        self.services: weakref.WeakSet[ServiceParts] = weakref.WeakSet()
        self._snapshots: list[ServiceSnapshot] = []
        self._read_by: set[str] = set()

    def read(self, instrument: str) -> list[ServiceSnapshot]:
        if instrument in self._read_by or not self._read_by:
            self._snapshots = [take(parts) for parts in list(self.services)]
            self._read_by = set()
        self._read_by.add(instrument)
        return self._snapshots


_collection = _Collection()


def _pools(name: str, field: str, scale: float = 1.0) -> _Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(pool, field) * scale, {"fanout.pool.name": pool.name})
            for snapshot in _collection.read(name)
            for pool in snapshot.pools
        ]

    return callback


def _per_backend(name: str, read: Callable[[BackendSnapshot], float]) -> _Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(read(backend), {"fanout.backend": backend.name})
            for snapshot in _collection.read(name)
            for backend in snapshot.backends
        ]

    return callback


def _backend_up(options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(int(status.up), {"fanout.backend": status.name})
        for snapshot in _collection.read("fanout.backend.up")
        for status in snapshot.health
    ]


def _by_key(name: str, read: Callable[[ServiceSnapshot], Mapping[str, int]], key: str) -> _Callback:
    """A counter per key of the dicts ``read`` gives, added up over the live services."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[str, int] = {}
        for snapshot in _collection.read(name):
            for value, count in read(snapshot).items():
                totals[value] = totals.get(value, 0) + count
        return [Observation(count, {key: value}) for value, count in sorted(totals.items())]

    return callback


def _caller_counts(field: str) -> Callable[[ServiceSnapshot], Mapping[str, int]]:
    """One of each caller label's counts (:class:`CallerCounts`): the configured callers and
    the first names seen each have their own label, the rest ``other``."""

    def read(snapshot: ServiceSnapshot) -> Mapping[str, int]:
        return {label: getattr(counts, field) for label, counts in snapshot.callers.items()}

    return read


def _brownout_level(options: CallbackOptions) -> Iterable[Observation]:
    snapshots = _collection.read("fanout.brownout.level")
    return [Observation(max((s.brownout_level for s in snapshots), default=0.0))]


def _summed(name: str, read: Callable[[ServiceSnapshot], float]) -> _Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(read(snapshot) for snapshot in _collection.read(name)))]

    return callback


def _cache_store_up(options: CallbackOptions) -> Iterable[Observation]:
    caches = [s.cache for s in _collection.read("fanout.cache.store_up") if s.cache]
    return [Observation(min(cache.store_up for cache in caches))] if caches else []


def _cache_stat(field: str) -> Callable[[ServiceSnapshot], float]:
    def read(snapshot: ServiceSnapshot) -> float:
        return float(getattr(snapshot.cache, field)) if snapshot.cache else 0.0

    return read


_meter = metrics.get_meter("fanout")
for _name, _field, _scale, _unit, _description in (
    ("fanout.pool.size", "size", 1.0, "{slot}", "Slots in the pool"),
    ("fanout.pool.in_use", "in_use", 1.0, "{slot}", "Slots taken right now"),
    (
        "fanout.pool.in_use_p99",
        "in_use_p99",
        1.0,
        "{slot}",
        "99th percentile of slots taken, seen by arrivals (rolling window)",
    ),
    (
        "fanout.pool.wait_p99",
        "wait_p99_ms",
        0.001,
        "s",
        "99th percentile of the wait for a slot (rolling window)",
    ),
    (
        "fanout.pool.recommended",
        "recommended",
        1.0,
        "{slot}",
        "Little's law: offered rate x mean hold x headroom",
    ),
):
    _meter.create_observable_gauge(
        _name, [_pools(_name, _field, _scale)], unit=_unit, description=_description
    )
_meter.create_observable_gauge(
    "fanout.circuit.state",
    [_per_backend("fanout.circuit.state", lambda b: _STATE_VALUE[b.circuit])],
    unit="{state}",
    description="Circuit breaker: 0 closed, 1 half open, 2 open",
)
for _name, _read, _unit, _description in (
    ("fanout.circuit.opened", lambda b: b.opened, "{opening}", "Times the circuit opened"),
    (
        "fanout.backend.calls",
        lambda b: b.calls,
        "{call}",
        "Calls to the backend (each one's retries and hedges together)",
    ),
    (
        "fanout.backend.failures",
        lambda b: b.failures,
        "{call}",
        "Calls the backend failed: unreachable, timed out or 5xx, after any retries",
    ),
    (
        "fanout.backend.attempts",
        lambda b: b.attempts,
        "{attempt}",
        "Attempts made, retries and hedges included",
    ),
    (
        "fanout.backend.retries",
        lambda b: b.retries,
        "{attempt}",
        "Retries and hedges the budget allowed",
    ),
    (
        "fanout.backend.retries_refused",
        lambda b: b.retries_refused,
        "{attempt}",
        "Retries the budget refused",
    ),
    ("fanout.backend.hedges", lambda b: b.hedges, "{attempt}", "Hedged second attempts sent"),
):
    _meter.create_observable_counter(
        _name, [_per_backend(_name, _read)], unit=_unit, description=_description
    )
_meter.create_observable_gauge(
    "fanout.backend.up",
    [_backend_up],
    unit="{backend}",
    description="The backend answered its last health check: 1 up, 0 down",
)
for _name, _get, _unit, _description in (
    (
        "fanout.admission.limit",
        lambda s: s.admission_limit,
        "{call}",
        "The adaptive limit on calls in flight",
    ),
    (
        "fanout.admission.limit_min",
        lambda s: s.admission_min_limit,
        "{call}",
        "The least the adaptive limit may fall to (admission.min_limit)",
    ),
    (
        "fanout.admission.inflight",
        lambda s: s.calls_in_flight,
        "{call}",
        "Calls admitted and running",
    ),
    (
        "fanout.admission.queued",
        lambda s: s.calls_queued,
        "{call}",
        "Calls waiting for admission",
    ),
):
    _meter.create_observable_gauge(
        _name, [_summed(_name, _get)], unit=_unit, description=_description
    )
for _name, _get, _unit, _description in (
    (
        "fanout.calls.overloaded",
        lambda s: s.calls_overloaded,
        "{call}",
        "Calls answered Overloaded",
    ),
    (
        "fanout.calls.held",
        lambda s: s.calls_held,
        "{call}",
        "Overloaded answers held because the caller ignored retry_after_ms",
    ),
    ("fanout.tasks.started", lambda s: s.tasks.started, "{task}", "Tasks started"),
    (
        "fanout.event_loop.blocked",
        lambda s: s.event_loop_blocks,
        "{block}",
        "Greenlet runs that blocked the event loop past server.hub_block_threshold_ms",
    ),
    (
        "fanout.tasks.rejected",
        lambda s: s.tasks.rejected,
        "{task}",
        "Tasks that got no slot in time",
    ),
    (
        "fanout.tasks.abandoned",
        lambda s: s.tasks.abandoned,
        "{task}",
        "Tasks still running when their call answered",
    ),
    (
        "fanout.tasks.killed",
        lambda s: s.tasks.killed,
        "{task}",
        "Abandoned tasks killed after the grace period",
    ),
    (
        "fanout.tasks.coalesced",
        lambda s: s.tasks_coalesced,
        "{task}",
        "Tasks that shared an identical lookup's call instead of making their own",
    ),
):
    _meter.create_observable_counter(
        _name, [_summed(_name, _get)], unit=_unit, description=_description
    )
_meter.create_observable_counter(
    "fanout.calls.refused",
    [_by_key("fanout.calls.refused", lambda s: s.refused, "fanout.criticality")],
    unit="{call}",
    description="Calls answered Overloaded, by the criticality they carried",
)
_meter.create_observable_counter(
    "fanout.panels.skipped",
    [_by_key("fanout.panels.skipped", lambda s: s.skipped, "fanout.skip_reason")],
    unit="{panel}",
    description="Panels answered SKIPPED, not run: brownout (shed under load) or disabled",
)
_meter.create_observable_gauge(
    "fanout.brownout.level",
    [_brownout_level],
    unit="1",
    description="The brownout dimmer: 0 nothing shed, 1 all that may be shed",
)

for _name, _field, _unit, _description in (
    ("fanout.cache.hits", "hits", "{bucket}", "Buckets read from the results cache"),
    ("fanout.cache.misses", "misses", "{bucket}", "Buckets not found in the results cache"),
    ("fanout.cache.fills", "fills", "{bucket}", "Buckets queried and stored"),
    (
        "fanout.cache.evictions",
        "evictions",
        "{bucket}",
        "Buckets dropped from the in-process store to stay within cache.max_bytes",
    ),
    (
        "fanout.cache.direct",
        "direct",
        "{window}",
        "Windows answered by the panel's own query: a bucket's groups too many to keep, "
        "or the store not answering",
    ),
    (
        "fanout.cache.query_windows",
        "query_windows",
        "{window}",
        "Windows the panel's own query answered: it measured cheaper on this engine than "
        "the cached buckets (its plan timings, run for no caller, are not counted)",
    ),
    (
        "fanout.cache.timings",
        "timings",
        "{timing}",
        'Timings of both plans of a window, run to choose the cheaper (cache.plan = "measured")',
    ),
    (
        "fanout.cache.timings_failed",
        "timings_failed",
        "{timing}",
        "Timings that gave no ratio: a plan failed or ran out of its time",
    ),
    (
        "fanout.cache.timings_crowded",
        "timings_crowded",
        "{timing}",
        "Timings run under load: the engine was never found alone within their wait",
    ),
    (
        "fanout.cache.redis_errors",
        "redis_errors",
        "{error}",
        "Redis commands that failed or timed out (their buckets were queried)",
    ),
):
    _meter.create_observable_counter(
        _name,
        [_summed(_name, _cache_stat(_field))],
        unit=_unit,
        description=_description,
    )
_meter.create_observable_gauge(
    "fanout.cache.timings_running",
    [_summed("fanout.cache.timings_running", _cache_stat("timings_running"))],
    unit="{timing}",
    description="Probes of both plans running now, for no caller",
)
_meter.create_observable_gauge(
    "fanout.cache.bytes",
    [_summed("fanout.cache.bytes", _cache_stat("bytes"))],
    unit="By",
    description="What this process's results cache holds: buckets' keys and values, and the "
    "sums of whole runs of them",
)
_meter.create_observable_gauge(
    "fanout.cache.store_up",
    [_cache_store_up],
    unit="1",
    description="The results cache's store answered its last command: 1, or 0 while Redis "
    "is down (only with the cache on)",
)
for _name, _field, _description in (
    ("fanout.callers.admitted", "admitted", "Calls admitted, by caller (fair share)"),
    ("fanout.callers.refused", "refused", "Calls answered Overloaded, by caller (fair share)"),
):
    _meter.create_observable_counter(
        _name,
        [_by_key(_name, _caller_counts(_field), "fanout.caller")],
        unit="{call}",
        description=_description,
    )
_meter.create_observable_gauge(
    "fanout.callers.in_flight",
    [_by_key("fanout.callers.in_flight", _caller_counts("inflight"), "fanout.caller")],
    unit="{call}",
    description="Calls in flight, by caller (fair share)",
)
