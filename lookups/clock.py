"""The clock: the one place Fanout's code reads the time.

Everything that measures an interval, sets a deadline or waits for a moment reads a
:class:`Clock` given to it where the service is built (``FanOutService(clock=...)``), as
trio's code reads its run's clock: :class:`~lookups.deadline.Deadline`, admission, the
gate and its pacing, the dimmer, the breaker, the retry budget, hedging and the
coalescer, the fair shares, the waiting line, the pools' meters, the health checks and
the results cache's dates. Every part takes this one shape, never a bare callable. A
test of timing behaviour gives them a clock it moves by hand (``FakeClock``, shipped
with the product in ``service.testing``), so a breaker's open period or a refill ends
exactly when the test says, however busy the machine is.

Two readings, never mixed:

* :meth:`Clock.monotonic`: seconds on a clock that never goes back, for intervals and
  deadlines (``CLOCK_MONOTONIC``; its resolution is that of ``time.perf_counter`` on
  Linux, so one clock serves both).
* :meth:`Clock.wall`: seconds since the epoch, for dates (a dashboard's time window, a
  heartbeat file's age).

Every wait goes through it too: a pause (:meth:`Clock.sleep`), an event
(:meth:`Clock.wait`), a greenlet or a result to come (:meth:`Clock.join`). On a
``FakeClock`` they end when the test moves the clock past them.

Where a process is put together (``run_server`` for ``fanout serve`` and each worker, the
worker supervisor, each command of the command line), it chooses the clock,
:data:`SYSTEM_CLOCK`, and hands it to the parts it builds. Two parts read the machine's
clock themselves, because what they compare with counts real time: the wire's frame
timeout (the socket's timeouts, which the kernel counts) and the hub monitor (gevent's
switch tracer stamps the loop's runs). Spans are dated as OpenTelemetry dates them, by
:func:`span_time_ns`: a trace shows when things happened, whatever clock a test gives the
parts.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import gevent

__all__ = [
    "SYSTEM_CLOCK",
    "Clock",
    "SystemClock",
    "Waitable",
    "Joinable",
    "loop_time",
    "span_time_ns",
]


class Clock(Protocol):
    """What reads the time: a monotonic reading for intervals, a wall reading for dates."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (UTC)."""
        ...

    def wait(self, event: Waitable, until: float) -> bool:
        """Wait for ``event`` until ``until`` on :meth:`monotonic`; True if it is set."""
        ...

    def join(self, task: Joinable, until: float) -> bool:
        """Wait for ``task`` to finish until ``until`` on :meth:`monotonic`; True if it has."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on :meth:`monotonic` (0: only let the others run)."""
        ...


class Waitable(Protocol):
    """An event to wait for (``gevent.event.Event``, ``threading.Event``)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Any: ...


class Joinable(Protocol):
    """Something of gevent's that finishes once: a ``Greenlet``, an ``AsyncResult``."""

    def ready(self) -> bool: ...

    def rawlink(self, callback: Any) -> None: ...


class SystemClock:
    """The machine's clocks: ``time.monotonic`` and ``time.time``."""

    __slots__ = ()

    # Bound straight to the C functions: a reading costs what time.monotonic() costs.
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)

    def wait(self, event: Waitable, until: float) -> bool:
        event.wait(timeout=max(0.0, until - time.monotonic()))
        return event.is_set()

    def join(self, task: Joinable, until: float) -> bool:
        if not task.ready():  # gevent.wait costs far more than the check when it is
            gevent.wait((task,), timeout=max(0.0, until - time.monotonic()))
        return task.ready()

    # gevent's sleep under the server's patching; a thread's otherwise.
    sleep = staticmethod(time.sleep)

    def __repr__(self) -> str:
        return "SystemClock()"


#: The machine's clock, the default wherever a clock may be given.
SYSTEM_CLOCK: Clock = SystemClock()


def loop_time(loop: Any) -> float:
    """The time of the gevent ``loop``'s current turn, the base its timers count from.

    On the monotonic clock, read once per turn by the loop: a timer set for a moment
    computed from it (a hold ending on a tick) ends in the turn that moment falls in.
    """
    now: float = loop.now()
    return now


def span_time_ns() -> int:
    """Wall time in nanoseconds, as the OpenTelemetry SDK dates spans and their events."""
    return time.time_ns()
