"""One reading of a running service's state: what ``pool_stats()`` and the metrics report.

:class:`ServiceParts` is what a running service is made of, built once by the composition
root (:mod:`service.app`): the engine, the gate, the backends and their health checker, the
coalescer, the results cache, and the count of panels answered without running.
:func:`take` reads them into a :class:`ServiceSnapshot` of plain values. The pool report
(:mod:`service.rpc.pool_report`) and the metrics (:mod:`service.operations.service_metrics`)
read snapshots, never the parts, so the two say the same thing the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from lookups.backends.collection import Backends
from lookups.cache.stores import BucketStore, CacheStats
from lookups.clock import Clock
from lookups.resilience.breaker import CircuitState
from lookups.resilience.guard import BackendGuard
from service.engine.coalescing import Coalescer
from service.engine.fanout import FanOut, FanOutStats
from service.operations.health import BackendStatus, HealthChecker, store_statuses
from service.operations.hub_monitor import HubMonitor
from service.overload.fair_share import CallerCounts
from service.overload.gate import CallGate
from tracing.pools import PoolMeter, PoolReport

__all__ = ["ServiceParts", "ServiceSnapshot", "BackendSnapshot", "take"]


def _no_skips() -> dict[str, int]:
    return {"brownout": 0, "disabled": 0}


@dataclass(eq=False)  # a service's own parts: one is equal only to itself
class ServiceParts:
    """The parts of one service that hold state worth reporting, and the clock they read.

    ``hub_monitor`` counts the event loop's blocks (none: not watched).

    ``cache_max_bytes`` is what the results cache may hold in this process (0: its buckets
    are in Redis). ``skipped`` counts the panels answered ``SKIPPED`` (not run), by reason
    (``brownout``: shed under load; ``disabled``); the handler counts them.
    """

    clock: Clock
    fanout: FanOut
    gate: CallGate
    backends: Backends
    health: HealthChecker
    coalescer: Coalescer | None = None
    cache: BucketStore | None = None
    cache_max_bytes: int = 0
    hub_monitor: HubMonitor | None = None
    skipped: dict[str, int] = field(default_factory=_no_skips)

    def stores(self) -> tuple[BackendStatus, ...]:
        """The results cache's shared store as the probes and ``health()`` show it."""
        return store_statuses(self.cache, self.cache is not None and self.cache_max_bytes == 0)

    def pool_meters(self) -> list[PoolMeter]:
        """The engine's pools, then each backend's."""
        return [*self.fanout.pool_meters, *(backend.meter for backend in self.backends)]


@dataclass(frozen=True)
class BackendSnapshot:
    """One backend's circuit and attempts: counts since start."""

    name: str
    circuit: CircuitState
    opened: int
    calls: int
    failures: int
    attempts: int
    retries: int
    retries_refused: int
    hedges: int


@dataclass(frozen=True)
class ServiceSnapshot:
    """A service's state at one instant: counts since start, except where a field says.

    ``brownout_peak``, ``calls_lighter`` and ``calls_shed`` are over the pools' rolling
    window; ``cache`` is ``None`` when the results cache is off; ``health`` is the last
    round of backend checks.
    """

    pools: tuple[PoolReport, ...]
    admission_limit: int
    admission_min_limit: int
    calls_in_flight: int
    calls_queued: int
    brownout_level: float
    brownout_peak: float
    calls_lighter: int
    calls_shed: int
    calls_overloaded: int
    calls_held: int
    refused: Mapping[str, int]
    tasks: FanOutStats
    tasks_coalesced: int
    skipped: Mapping[str, int]
    cache: CacheStats | None
    cache_max_bytes: int
    backends: tuple[BackendSnapshot, ...]
    health: tuple[BackendStatus, ...]
    event_loop_blocks: int = 0
    #: Calls admitted, refused and in flight by caller label (fair share)...
    callers: Mapping[str, CallerCounts] = field(default_factory=dict)
    #: ...and each label's weight, and its share of the limit now (0: not active).
    caller_weights: Mapping[str, float] = field(default_factory=dict)
    caller_shares: Mapping[str, float] = field(default_factory=dict)


def take(parts: ServiceParts) -> ServiceSnapshot:
    """Read ``parts`` once, copying every counter (the parts go on counting)."""
    admission, dimmer, gate_stats = (
        parts.gate.admission.snapshot(),
        parts.gate.dimmer,
        parts.gate.stats,
    )
    peak, lighter, shed = dimmer.recent()
    return ServiceSnapshot(
        pools=tuple(meter.report() for meter in parts.pool_meters()),
        admission_limit=admission.limit,
        admission_min_limit=admission.min_limit,
        calls_in_flight=admission.inflight,
        calls_queued=admission.queued,
        brownout_level=dimmer.level,
        brownout_peak=peak,
        calls_lighter=lighter,
        calls_shed=shed,
        calls_overloaded=gate_stats.overloaded,
        calls_held=gate_stats.held,
        refused=dict(gate_stats.refused),
        tasks=dataclasses.replace(parts.fanout.stats),
        tasks_coalesced=parts.coalescer.stats.followers if parts.coalescer else 0,
        skipped=dict(parts.skipped),
        cache=dataclasses.replace(parts.cache.stats) if parts.cache else None,
        cache_max_bytes=parts.cache_max_bytes,
        backends=tuple(_backend(backend.guard) for backend in parts.backends),
        health=parts.health.current(),
        event_loop_blocks=parts.hub_monitor.blocks_reported if parts.hub_monitor else 0,
        callers=admission.callers,
        caller_weights=admission.caller_weights,
        caller_shares=admission.caller_shares,
    )


def _backend(guard: BackendGuard) -> BackendSnapshot:
    return BackendSnapshot(
        name=guard.name,
        circuit=guard.breaker.state,
        opened=guard.breaker.opened,
        calls=guard.calls,
        failures=guard.failures,
        attempts=guard.attempts,
        retries=guard.budget.retries,
        retries_refused=guard.budget.refused,
        hedges=guard.hedges,
    )
