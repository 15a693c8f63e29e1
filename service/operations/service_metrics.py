"""The series read from a running service's own parts when a reader collects.

One registry: the services alive in this process (a server runs one; tests run
several). Each instrument's callback goes through each service's parts: its
:class:`~lookups.backends.collection.Backends` (each backend's pool, circuit,
retries and last health check), its engine, its gate and its coalescer. Nothing
is paid on the hot path; nothing at all while no meter provider is installed.

Series (names as Prometheus shows them: ``fanout_pool_size``, ...)::

    fanout.pool.size, .in_use, .in_use_p99, .wait_p99, .recommended   by fanout.pool.name
    fanout.circuit.state (0 closed, 1 half open, 2 open), fanout.circuit.opened,
    fanout.backend.attempts, .retries, .retries_refused, .hedges      by fanout.backend
    fanout.backend.up (1 up, 0 down, as last checked)                 by fanout.backend
    fanout.admission.limit, .inflight, .queued
    fanout.calls.overloaded, fanout.calls.held
    fanout.calls.refused                                              by fanout.criticality
    fanout.brownout.level (0 to 1, the dimmer), fanout.panels.skipped  by fanout.skip_reason
    fanout.tasks.started, .rejected, .abandoned, .killed, .coalesced
    fanout.cache.hits, .misses, .fills, .evictions, .direct, .redis_errors   (buckets; windows)
    fanout.cache.bytes (what this process holds: buckets' keys and values, kept sums)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from lookups.clock import SYSTEM_CLOCK
from lookups.resilience.breaker import CircuitState
from tracing.pools import PoolReport

__all__ = ["observe"]

# FanOutService objects (service.app): their backends, handler, health, gate, fanout, coalescer.
_services: weakref.WeakSet[Any] = weakref.WeakSet()
_REPORT_REUSE_S = 0.5  # one collection reads all five pool gauges well within this
_reports: tuple[float, list[PoolReport]] = (-1.0, [])
_STATE_VALUE = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}


def observe(service: Any) -> None:
    """Publish the series of ``service`` (a :class:`~service.app.FanOutService`) while it is
    alive."""
    _services.add(service)


def _live() -> list[Any]:
    return list(_services)


def _pool_reports() -> list[PoolReport]:
    """Every pool's report, computed once per collection."""
    global _reports
    now = SYSTEM_CLOCK.monotonic()
    if now - _reports[0] > _REPORT_REUSE_S:
        _reports = (
            now,
            [meter.report() for service in _live() for meter in service.handler.pool_meters()],
        )
    return _reports[1]


def _pools(field: str, scale: float = 1.0) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(report, field) * scale, {"fanout.pool.name": report.name})
            for report in _pool_reports()
        ]

    return callback


def _guards() -> Iterator[Any]:
    for service in _live():
        for backend in service.backends:
            yield backend.guard


def _per_backend(
    read: Callable[[Any], float],
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(read(guard), {"fanout.backend": guard.name}) for guard in _guards()]

    return callback


def _backend_up(options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(int(status.up), {"fanout.backend": status.name})
        for service in _live()
        for status in service.health.current()
    ]


def _by_key(
    read: Callable[[Any], dict[str, int]], attribute: str
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A counter per key of the dicts ``read`` gives, added up over the live services."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[str, int] = {}
        for service in _live():
            for key, count in read(service).items():
                totals[key] = totals.get(key, 0) + count
        return [Observation(count, {attribute: key}) for key, count in sorted(totals.items())]

    return callback


def _brownout_level(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(max((s.gate.dimmer.level for s in _live()), default=0.0))]


def _cache_stat(field: str, service: Any) -> float:
    return float(getattr(service.cache.stats, field)) if service.cache else 0.0


def _summed(read: Callable[[Any], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(read(service) for service in _live()))]

    return callback


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
        _name, [_pools(_field, _scale)], unit=_unit, description=_description
    )
_meter.create_observable_gauge(
    "fanout.circuit.state",
    [_per_backend(lambda g: _STATE_VALUE[g.breaker.state])],
    unit="{state}",
    description="Circuit breaker: 0 closed, 1 half open, 2 open",
)
for _name, _read, _unit, _description in (
    ("fanout.circuit.opened", lambda g: g.breaker.opened, "{opening}", "Times the circuit opened"),
    (
        "fanout.backend.attempts",
        lambda g: g.attempts,
        "{attempt}",
        "Attempts made, retries and hedges included",
    ),
    (
        "fanout.backend.retries",
        lambda g: g.budget.retries,
        "{attempt}",
        "Retries and hedges the budget allowed",
    ),
    (
        "fanout.backend.retries_refused",
        lambda g: g.budget.refused,
        "{attempt}",
        "Retries the budget refused",
    ),
    ("fanout.backend.hedges", lambda g: g.hedges, "{attempt}", "Hedged second attempts sent"),
):
    _meter.create_observable_counter(
        _name, [_per_backend(_read)], unit=_unit, description=_description
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
        lambda s: int(s.gate.admission.limit),
        "{call}",
        "The adaptive limit on calls in flight",
    ),
    (
        "fanout.admission.inflight",
        lambda s: s.gate.admission.inflight,
        "{call}",
        "Calls admitted and running",
    ),
    (
        "fanout.admission.queued",
        lambda s: s.gate.admission.queued,
        "{call}",
        "Calls waiting for admission",
    ),
):
    _meter.create_observable_gauge(_name, [_summed(_get)], unit=_unit, description=_description)
for _name, _get, _unit, _description in (
    (
        "fanout.calls.overloaded",
        lambda s: s.gate.stats.overloaded,
        "{call}",
        "Calls answered Overloaded",
    ),
    (
        "fanout.calls.held",
        lambda s: s.gate.stats.held,
        "{call}",
        "Overloaded answers held because the caller ignored retry_after_ms",
    ),
    ("fanout.tasks.started", lambda s: s.fanout.stats.started, "{task}", "Tasks started"),
    (
        "fanout.tasks.rejected",
        lambda s: s.fanout.stats.rejected,
        "{task}",
        "Tasks that got no slot in time",
    ),
    (
        "fanout.tasks.abandoned",
        lambda s: s.fanout.stats.abandoned,
        "{task}",
        "Tasks still running when their call answered",
    ),
    (
        "fanout.tasks.killed",
        lambda s: s.fanout.stats.killed,
        "{task}",
        "Abandoned tasks killed after the grace period",
    ),
    (
        "fanout.tasks.coalesced",
        lambda s: s.coalescer.stats.followers if s.coalescer is not None else 0,
        "{task}",
        "Tasks that shared an identical lookup's call instead of making their own",
    ),
):
    _meter.create_observable_counter(_name, [_summed(_get)], unit=_unit, description=_description)
_meter.create_observable_counter(
    "fanout.calls.refused",
    [_by_key(lambda s: s.gate.stats.refused, "fanout.criticality")],
    unit="{call}",
    description="Calls answered Overloaded, by the criticality they carried",
)
_meter.create_observable_counter(
    "fanout.panels.skipped",
    [_by_key(lambda s: s.handler.skipped, "fanout.skip_reason")],
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
        "fanout.cache.redis_errors",
        "redis_errors",
        "{error}",
        "Redis commands that failed or timed out (their buckets were queried)",
    ),
):
    _meter.create_observable_counter(
        _name,
        [_summed(functools.partial(_cache_stat, _field))],
        unit=_unit,
        description=_description,
    )
_meter.create_observable_gauge(
    "fanout.cache.bytes",
    [_summed(lambda s: s.cache.stats.bytes if s.cache else 0)],
    unit="By",
    description="What this process's results cache holds: buckets' keys and values, and the "
    "sums of whole runs of them",
)
