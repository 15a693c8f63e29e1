"""Clocks for tests of timing, shipped with the product as trio ships ``MockClock``.

:class:`FakeClock` is moved by hand, as trio's ``MockClock`` and Twisted's
``task.Clock``. Give it where the product takes a clock (``FanOutService(clock=...)``,
``CallGate``, ``CircuitBreaker``, ``RetryBudget``, ``ConnectionPacing``,
``Deadline.after_ms(ms, clock)``): time stands still until :meth:`FakeClock.advance`
moves it, so a test of timing behaviour asserts exactly what happens at a moment, and
takes no wall time however busy the machine is. A wait on a deadline
(:meth:`FakeClock.wait` for an event, :meth:`FakeClock.join` for a greenlet or a result)
ends when what it waits for is done or when ``advance`` moves the clock past the
deadline, never by wall time.

:class:`SkippingClock` is the machine's time with jumps, for a whole service whose
sockets and timeouts must run.

    from service.testing import FakeClock

    clock = FakeClock()
    service = FanOutService(settings, clock=clock)
    clock.advance(30.0)    # a breaker's open period passes at once
"""

from __future__ import annotations

from typing import Any

import gevent
from gevent.event import Event

from lookups.clock import SYSTEM_CLOCK, Joinable, Waitable

__all__ = ["FakeClock", "SkippingClock"]


class FakeClock:
    """Monotonic time from ``start`` (seconds), wall time from ``wall_start``; both move only
    with :meth:`advance`."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._moved = Event()  # set and replaced at each advance: wakes every waiter

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self.advance(value - self._now)

    def advance(self, seconds: float) -> None:
        """Move the clock on; waits whose deadline it passes end, and run before this returns."""
        self._moved = _moved_on(self._moved, seconds)
        self._now += seconds
        gevent.sleep(0)  # let the woken waiters run now

    def wait(self, event: Waitable, until: float) -> bool:
        return self.join(_as_gevent(event), until)  # a gevent event finishes as a task does

    def join(self, task: Joinable, until: float) -> bool:
        while not task.ready() and self._now < until:
            gevent.wait([task, self._moved], count=1)
        return task.ready()

    def sleep(self, seconds: float) -> None:
        """Until :meth:`advance` moves the clock ``seconds`` on (0: let the others run)."""
        until = self._now + seconds
        gevent.sleep(0)
        while self._now < until:
            self._moved.wait()

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now})"


def _moved_on(moved: Event, seconds: float) -> Event:
    """Wake every wait on the clock (``moved``) as it moves ``seconds`` on; the next event."""
    if seconds < 0:
        raise ValueError("a monotonic clock never goes back")
    moved.set()
    return Event()


def _as_gevent(event: Waitable) -> Any:
    """The product waits on gevent events; a test's threading.Event would block the hub."""
    if not isinstance(event, Event):
        raise TypeError(f"FakeClock waits on gevent events, not {type(event).__name__}")
    return event


class SkippingClock:
    """The machine's time, plus the jumps a test makes with :meth:`skip`.

    For a whole service, where time must flow (timeouts, sockets) but a long period
    (a breaker's open time) should pass at once: the test sets the period long enough that
    a slow machine cannot outlive it, then skips it. Skip only while no call is in flight:
    a deadline set before a skip is that much nearer after it.
    """

    def __init__(self) -> None:
        self._offset = 0.0
        self._moved = Event()

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic() + self._offset

    def wall(self) -> float:
        return SYSTEM_CLOCK.wall() + self._offset

    def skip(self, seconds: float) -> None:
        self._moved = _moved_on(self._moved, seconds)
        self._offset += seconds

    def wait(self, event: Waitable, until: float) -> bool:
        return self.join(_as_gevent(event), until)  # a gevent event finishes as a task does

    def join(self, task: Joinable, until: float) -> bool:
        while not task.ready() and self.monotonic() < until:
            gevent.wait([task, self._moved], count=1, timeout=until - self.monotonic())
        return task.ready()

    def sleep(self, seconds: float) -> None:
        """``seconds`` of the machine's time, or less if :meth:`skip` jumps past them."""
        until = self.monotonic() + seconds
        gevent.sleep(0)
        while self.monotonic() < until:
            self._moved.wait(timeout=until - self.monotonic())
