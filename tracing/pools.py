"""Pools an operator can see and size: slots that measure their own use.

:class:`MeteredSlots` wraps a bounded semaphore (gevent's, or a thread one) and
keeps, per pool, what Little's law needs over a rolling window
(:data:`WINDOW_S`): how many acquisitions were attempted (the offered arrival
rate, including the ones that waited in vain), how long slots were held
(the busy time, integrated as slots change hands), and how long takers waited,
and how many takers wanted a slot at once (holding one or waiting for one).
:meth:`PoolMeter.report` turns that into a :class:`PoolReport` whose
``recommended`` size is the mean number wanting a slot times :data:`HEADROOM`:
Little's law, arrival rate x (mean wait + mean hold). Counting the waits matters
once the pool is saturated: the holds then understate the need (a pool that
serves its takers one after another is busy no more than its size, and a taker
that got its slot only as its budget ran out holds it for an instant).

Why our own rather than reading the OpenTelemetry SDK's aggregates back: the
sizing needs a rolling window (an SDK histogram is cumulative or per export
interval, and an exporter may be off), and it must cost a few integer updates
per acquisition: the engine takes two slots per task. The same figures are
published as metrics (see :func:`observe_pools`).

Everything here is hub-local: no locks, no switches inside an update.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from lookups.clock import Clock
from lookups.flow import NO_FLOW, Flow

__all__ = [
    "WINDOW_S",
    "HEADROOM",
    "PoolMeter",
    "DemandMeter",
    "PoolReport",
    "MeteredSlots",
    "cpu_demand_s",
]

#: The rolling window the report covers, in seconds, kept as BUCKETS buckets.
WINDOW_S = 60.0
BUCKETS = 6
#: Spare capacity the recommendation adds above the measured need.
HEADROOM = 1.25
#: The event loop's thread wanted a core at least this share of the window (running on
#: one, or ready and waiting for one): the loop was saturated, and waits for slots came
#: from the CPU, not from too few slots.
CPU_SATURATED = 0.9
_SCHEDSTAT = "/proc/self/schedstat"
# Wait times are counted in power-of-two buckets of microseconds: 1 us .. ~1.1 h.
_WAIT_BUCKETS = 32
_DEMANDS_KEPT = 4096


def cpu_demand_s() -> float:
    """Seconds the main thread (the event loop's) has run on a core or waited, ready, for one.

    Linux's ``/proc/self/schedstat``: time on a CPU, then time on a run queue. The wait
    counts because on a busy machine a saturated loop gets less than a core: with three
    runnable processes on two cores it ran 0.67 of the time and was never idle, which
    the CPU time alone (``time.process_time()``, the fallback elsewhere) called spare.
    """
    try:
        with open(_SCHEDSTAT, "rb") as stats:
            running_ns, waiting_ns = stats.read().split()[:2]
        return (int(running_ns) + int(waiting_ns)) / 1e9
    except (OSError, ValueError):
        return time.process_time()


class Semaphore(Protocol):
    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool: ...
    def release(self) -> None: ...


class PlacedSemaphore(Protocol):
    """A semaphore whose waiters take a place in its line (a backend's slots)."""

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, flow: Flow = NO_FLOW
    ) -> bool: ...
    def release(self) -> None: ...


@dataclass(frozen=True)
class PoolReport:
    """One pool over the rolling window; ``recommended`` is Little's law plus headroom:
    the mean number of takers holding or waiting for a slot, times :data:`HEADROOM`."""

    name: str
    size: int
    in_use: int
    in_use_p99: int
    wait_p99_ms: float
    offered_per_s: float
    hold_ms: float
    timeouts: int
    recommended: int
    window_s: float
    limited_by: str = ""  # "slots": too few; "cpu": waits came from a saturated CPU; "" neither


class _Bucket:
    __slots__ = (
        "started",
        "cpu_started",
        "attempts",
        "acquired",
        "timeouts",
        "busy_s",
        "wanted_s",
        "in_use_counts",
        "in_use_top",
        "wait_counts",
    )

    def __init__(self, started: float, size: int) -> None:
        self.started = started
        self.cpu_started = cpu_demand_s()
        self.attempts = self.acquired = self.timeouts = 0
        self.busy_s = self.wanted_s = 0.0
        self.in_use_counts = [0] * (size + 2)  # in use seen by each arrival, 0..size(+1)
        self.in_use_top = 0  # the highest index counted: a report sums no further
        self.wait_counts = [0] * _WAIT_BUCKETS


class PoolMeter:
    """The rolling statistics of one named pool of ``size`` slots, over the last
    ``window_s`` seconds (:data:`WINDOW_S`), timed by ``clock`` (the service's,
    :mod:`lookups.clock`)."""

    def __init__(self, name: str, size: int, window_s: float = WINDOW_S, *, clock: Clock) -> None:
        self.name = name
        self._clock = clock
        self.size = size
        self.window_s = window_s
        self.in_use = 0
        self.waiting = 0
        self._changed_at = self._created_at = clock.monotonic()
        self._buckets: list[_Bucket] = [_Bucket(self._changed_at, size)]

    def _current(self, now: float) -> _Bucket:
        bucket = self._buckets[-1]
        if now - bucket.started < self.window_s / BUCKETS:
            return bucket
        bucket = _Bucket(now, self.size)
        self._buckets.append(bucket)
        # A true rolling window: a bucket that ended before it is gone, however long
        # ago the last event was (a bucket takes events for one width after it starts).
        width = self.window_s / BUCKETS
        while len(self._buckets) > 1 and self._buckets[0].started + width <= now - self.window_s:
            del self._buckets[0]
        return bucket

    def _integrate(self, now: float, bucket: _Bucket) -> None:
        elapsed = now - self._changed_at
        bucket.busy_s += self.in_use * elapsed
        bucket.wanted_s += (self.in_use + self.waiting) * elapsed
        self._changed_at = now

    def arriving(self) -> float:
        """Note an attempt to take a slot; returns the moment, for :meth:`taken`."""
        now = self._clock.monotonic()
        bucket = self._current(now)
        self._integrate(now, bucket)
        self.waiting += 1
        bucket.attempts += 1
        index = min(self.in_use, self.size + 1)
        bucket.in_use_counts[index] += 1
        if index > bucket.in_use_top:
            bucket.in_use_top = index
        return now

    def taken(self, since: float) -> None:
        """A slot was taken after waiting since ``since``."""
        now = self._clock.monotonic()
        bucket = self._current(now)
        self._integrate(now, bucket)
        self.waiting -= 1
        self.in_use += 1
        bucket.acquired += 1
        bucket.wait_counts[_wait_bucket(now - since)] += 1

    def gave_up(self, since: float) -> None:
        """No slot came free before the taker's timeout."""
        now = self._clock.monotonic()
        bucket = self._current(now)
        self._integrate(now, bucket)
        self.waiting -= 1
        bucket.timeouts += 1
        bucket.wait_counts[_wait_bucket(now - since)] += 1

    def returned(self) -> None:
        now = self._clock.monotonic()
        self._integrate(now, self._current(now))
        self.in_use -= 1

    def report(self) -> PoolReport:
        """The pool over the rolling window (to now)."""
        now = self._clock.monotonic()
        self._integrate(now, self._current(now))
        buckets = self._buckets
        # The whole window (idle time without buckets counts as idle), or since the
        # oldest bucket began when it straddles the window's start.
        window_s = max(now - buckets[0].started, min(now - self._created_at, self.window_s), 1e-3)
        attempts = sum(b.attempts for b in buckets)
        acquired = sum(b.acquired for b in buckets)
        busy_s = sum(b.busy_s for b in buckets)
        offered = attempts / window_s
        hold_s = busy_s / acquired if acquired else 0.0
        wanted = sum(b.wanted_s for b in buckets) / window_s
        in_use_p99 = min(
            _p99_index(_sum_columns(b.in_use_counts[: b.in_use_top + 1] for b in buckets)),
            self.size,
        )
        wait_index = _p99_index(_sum_columns(b.wait_counts for b in buckets))
        wait_p99_ms = 0.0 if wait_index <= 0 else round((2**wait_index) / 1000.0, 3)
        timeouts = sum(b.timeouts for b in buckets)
        cpu_share = (cpu_demand_s() - buckets[0].cpu_started) / max(now - buckets[0].started, 1e-3)
        recommended, limited_by = self._advice(
            attempts,
            wanted,
            in_use_p99,
            waited=wait_p99_ms > 0 or timeouts > 0,
            cpu_saturated=cpu_share >= CPU_SATURATED,
        )
        return PoolReport(
            self.name,
            self.size,
            self.in_use,
            in_use_p99,
            wait_p99_ms,
            round(offered, 2),
            round(hold_s * 1000.0, 3),
            timeouts,
            recommended,
            round(window_s, 1),
            limited_by,
        )

    def _advice(
        self, attempts: int, wanted: float, in_use_p99: int, waited: bool, cpu_saturated: bool
    ) -> tuple[int, str]:
        """The recommended size and what is short ("slots", "cpu" or nothing)."""
        if not attempts:
            return self.size, ""  # nothing measured: nothing to change
        # Never below what the pool had in use at p99: that much was needed.
        need = max(1, math.ceil(wanted * HEADROOM), in_use_p99)
        if need <= self.size or not waited:
            return need, ""
        if cpu_saturated:
            # Takers waited because the loop had no CPU to finish the holders' work:
            # more slots would only queue more work for the same core.
            return self.size, "cpu"
        return need, "slots"


class DemandMeter(PoolMeter):
    """A pool made anew for each request (the engine's ``fanout.pool_size``).

    What sizes it is how many slots one request wants at once: :meth:`wanted`
    records that per request (the last :data:`_DEMANDS_KEPT`), and the
    recommendation is its 99th percentile.
    """

    def __init__(self, name: str, size: int, *, clock: Clock) -> None:
        super().__init__(name, size, clock=clock)
        self._demands: deque[int] = deque(maxlen=_DEMANDS_KEPT)

    def wanted(self, slots: int) -> None:
        self._current(self._clock.monotonic()).attempts += 1
        self._demands.append(slots)

    def report(self) -> PoolReport:
        base = super().report()
        demands = sorted(self._demands)
        want_p99 = (
            demands[min(len(demands) - 1, math.ceil(len(demands) * 0.99) - 1)] if demands else 0
        )
        return PoolReport(
            base.name,
            self.size,
            base.in_use,
            min(want_p99, self.size),
            base.wait_p99_ms,
            base.offered_per_s,
            base.hold_ms,
            base.timeouts,
            max(1, want_p99),
            base.window_s,
            "slots" if want_p99 > self.size else "",
        )


def _wait_bucket(seconds: float) -> int:
    micros = int(seconds * 1e6)
    return min(micros.bit_length(), _WAIT_BUCKETS - 1)


def _sum_columns(rows: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for row in rows:
        if len(total) < len(row):
            total.extend([0] * (len(row) - len(total)))
        for index, count in enumerate(row):
            total[index] += count
    return total


def _p99_index(counts: list[int]) -> int:
    """The index at the 99th percentile of a histogram given as counts per index."""
    total = sum(counts)
    if not total:
        return 0
    rank, seen = math.ceil(total * 0.99), 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= rank:
            return index
    return len(counts) - 1


class MeteredSlots:
    """A bounded semaphore that reports to a :class:`PoolMeter`.

    ``acquire(timeout=...)`` and ``release()`` behave as the wrapped semaphore's;
    every attempt, wait, give-up and hold is counted on the way. ``acquire``'s ``flow``,
    the waiter's place in the line, goes to a semaphore that takes one
    (:class:`PlacedSemaphore`); ``None`` calls one that does not.
    """

    __slots__ = ("_slots", "meter", "__weakref__")

    def __init__(self, slots: Semaphore | PlacedSemaphore, meter: PoolMeter) -> None:
        self._slots: Any = slots
        self.meter = meter

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, flow: Flow | None = None
    ) -> bool:
        since = self.meter.arriving()
        if flow is None:
            taken = self._slots.acquire(blocking, timeout)
        else:
            taken = self._slots.acquire(blocking, timeout, flow)
        if taken:
            self.meter.taken(since)
            return True
        self.meter.gave_up(since)
        return False

    def release(self) -> None:
        self.meter.returned()
        self._slots.release()

    def locked(self) -> bool:
        """True while every slot is taken."""
        return self.meter.in_use >= self.meter.size

    def __repr__(self) -> str:
        return f"<MeteredSlots {self.meter.name} {self.meter.in_use}/{self.meter.size}>"
