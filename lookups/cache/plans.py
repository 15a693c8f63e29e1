"""Which plan answers a cached panel's windows, chosen by what each costs on this engine.

A window has two plans. The cache's (``BUCKETS``): the buckets read from the store, the
missing ones filled, the window's uneven edges queried. The panel's own (``QUERY``): one
query over the whole window. Which costs less depends on the engine (see
docs/explanation/results-cache.md), so :class:`PlanChooser` measures it as the panel runs,
never from the engine's name, by **timings alone on the engine**:

* The query answers until a timing has measured the buckets cheaper.
* A timing runs both plans for the window just answered again, in a greenlet and a trace
  of its own, one after the other, each timed, when this process has nothing else in
  flight on the engine (:class:`EngineUse`): a plan's time is then the engine's work and
  round trips, not a wait behind other queries. The first timing fills the buckets once,
  untimed, before timing the pair; later ones fill what the buckets lack, so they
  measure what going back to the buckets costs now.
* A run another operation overlapped is not counted; the timing tries again at the next
  quiet moment, a few times, and on its last try times both plans back to back under the
  load of the moment (an engine this process never leaves alone), where both wait behind
  the same queue and the difference is their work.
* The median of the last few ratios (buckets over query) chooses; the query wherever the
  two cost the same.
* Timings come once per ``cache.replan_ms``, a period that doubles, up to
  :data:`MAX_REPLAN_FACTOR` times, while they keep choosing the same plan, and is back to
  ``cache.replan_ms`` when one changes it; after a timing alone, it is at least as many
  times ``cache.replan_ms`` as the dearer plan cost the cheaper, up to the same bound.

Each plan of a timing is bounded by :data:`TIMING_BUDGET_S`, and a failure fails nothing:
that timing gives no ratio. Other processes' work on the same engine only makes a timing
noisier.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol, TypeVar

import gevent

from lookups.cache.stores import CacheStats
from lookups.clock import SYSTEM_CLOCK, Clock, Waitable

__all__ = [
    "Plan",
    "PlanChooser",
    "EngineUse",
    "TIMING_BUDGET_S",
    "TIMINGS_KEPT",
    "MAX_REPLAN_FACTOR",
]

T = TypeVar("T")

#: How many times ``cache.replan_ms`` the period between timings grows to while they agree.
MAX_REPLAN_FACTOR = 8
#: Timings whose ratios the choice takes the median of: one slow moment does not flip it.
TIMINGS_KEPT = 5
#: Each plan of a timing gets this long: a plan slower than that alone has lost anyway.
TIMING_BUDGET_S = 5.0
#: Quiet moments a timing tries before it times both plans under the load of the moment.
PROBE_ATTEMPTS = 5
#: How long a timing waits for a quiet moment (half a replan period, if shorter).
QUIET_WAIT_S = 5.0


class Plan(Enum):
    """How a cached panel answers a window."""

    BUCKETS = "buckets"  # the cached buckets and a query of the edges
    QUERY = "query"  # the panel's own query over the whole window


class EngineUse(Protocol):
    """What this process has in flight on one engine: its backend's operations."""

    @property
    def idle(self) -> Waitable:
        """Set while no operation is in flight."""
        ...

    @property
    def overlaps(self) -> int:
        """Operations begun while another was in flight, since the backend opened."""
        ...


class PlanChooser:
    """The plan of each window of one panel, by timings of both plans alone on the engine.

    :meth:`answer` answers a window. Not thread-safe: one event loop's greenlets share
    it, as they share the panel.
    """

    def __init__(
        self, replan_s: float, use: EngineUse, stats: CacheStats, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        """``replan_s``: how often a window is timed at first; ``use``: the engine's
        operations in flight, to find it alone; ``stats``: where the timings are counted (the
        store's, shared by its panels); ``clock``: the service's."""
        self._replan_s = self.period_s = replan_s
        self._use, self._clock = use, clock
        self._ratios: deque[float] = deque(maxlen=TIMINGS_KEPT)
        self._timed_at: float | None = None
        self._timer: gevent.Greenlet | None = None
        self.stats = stats

    @property
    def ratio(self) -> float | None:
        """The median of the kept timings' buckets-over-query times; None before the first."""
        return statistics.median(self._ratios) if self._ratios else None

    @property
    def chosen(self) -> Plan:
        """The plan the timings found cheaper (the query until then, and on a tie)."""
        ratio = self.ratio
        return Plan.BUCKETS if ratio is not None and ratio < 1.0 else Plan.QUERY

    def answer(self, by_plan: Callable[[Plan], T], timing: Callable[[Plan], Any]) -> T:
        """``by_plan(chosen)``; when a timing is due, ``timing(plan)`` then runs each plan in
        the background, alone on the engine, to time it."""
        chosen = self.chosen
        value = by_plan(chosen)
        if self._timing_due():
            self._timed_at = self._clock.monotonic()
            self.stats.timings += 1
            self.stats.timings_running += 1
            # A greenlet starts with an empty context: the timing is no part of this call.
            self._timer = gevent.spawn(self._timing, chosen, timing)
        return value

    def join_timing(self, timeout_s: float | None = None) -> None:
        """Wait for the timing running now, if any, to end."""
        timer = self._timer
        if timer is None:
            return
        if timeout_s is None:
            timer.join()
        else:
            self._clock.join(timer, self._clock.monotonic() + timeout_s)

    def record(
        self, first: Plan, first_s: float, second: Plan, second_s: float, alone: bool = True
    ) -> None:
        """A timing: ``first`` took ``first_s``, ``second`` (the other plan) ``second_s``;
        ``alone``: each on an engine otherwise idle. The next timing comes twice as late if
        the choice stays, one period later if not; and, timed alone, at least as many
        periods later as one plan cost times the other (at most :data:`MAX_REPLAN_FACTOR`):
        a plan many times dearer does not become the cheaper soon."""
        before = self.chosen if self._ratios else None
        self._add_ratio(first, first_s, second_s)
        factor = 2 * self.period_s / self._replan_s if self.chosen is before else 1.0
        ratio = self.ratio
        if alone and ratio is not None:
            factor = max(factor, ratio, 1 / ratio if ratio > 0 else MAX_REPLAN_FACTOR)
        self.period_s = self._replan_s * min(factor, MAX_REPLAN_FACTOR)

    def _add_ratio(self, first: Plan, first_s: float, second_s: float) -> None:
        buckets_s, query_s = (first_s, second_s) if first is Plan.BUCKETS else (second_s, first_s)
        if query_s > 0:
            self._ratios.append(buckets_s / query_s)
        else:  # below the clock's tick: the query is the cheaper unless both were
            self._ratios.append(float("inf") if buckets_s > 0 else 1.0)

    def _timing_due(self) -> bool:
        if self._timer is not None:
            return False
        if self._timed_at is None:
            return True
        return self._clock.monotonic() - self._timed_at >= self.period_s

    def _timing(self, first: Plan, run: Callable[[Plan], Any]) -> None:
        """Both plans, each timed alone on the engine, at the first quiet moments; if none
        comes, both back to back under the load of the moment (its last try)."""
        second = Plan.QUERY if first is Plan.BUCKETS else Plan.BUCKETS
        wait_s = min(self._replan_s / 2, QUIET_WAIT_S)
        try:
            if not self._ratios:  # the buckets have answered nothing yet: fill them first
                self._clock.wait(self._use.idle, self._clock.monotonic() + wait_s)
                run(Plan.BUCKETS)
            until = self._clock.monotonic() + wait_s
            for attempt in range(PROBE_ATTEMPTS):
                quiet = self._clock.wait(self._use.idle, until)
                last = not quiet or attempt == PROBE_ATTEMPTS - 1
                times = self._pair(run, first, second, whole=last)
                if times is None:
                    continue
                alone = quiet and times[2]
                if alone or last:
                    self.record(first, times[0], second, times[1], bool(alone))
                    self.stats.timings_crowded += not alone
                    return
        except Exception:  # noqa: BLE001 - a timing answers no caller: it gives no ratio
            self.stats.timings_failed += 1
        finally:
            self._timer = None
            self.stats.timings_running -= 1

    def _pair(
        self, run: Callable[[Plan], Any], first: Plan, second: Plan, whole: bool
    ) -> tuple[float, float, bool] | None:
        """Each plan's time, and whether no other operation overlapped them; None when one
        overlapped the first and ``whole`` is false (the second is not run for nothing)."""
        overlaps = self._use.overlaps
        first_s = self._timed(run, first)
        if not whole and self._use.overlaps != overlaps:
            return None
        second_s = self._timed(run, second)
        return first_s, second_s, self._use.overlaps == overlaps

    def _timed(self, run: Callable[[Plan], Any], plan: Plan) -> float:
        started = self._clock.monotonic()
        run(plan)
        return self._clock.monotonic() - started
