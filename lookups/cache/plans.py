"""Which plan answers a cached panel's windows, chosen by what each costs on this engine.

A window has two plans. The cache's (``BUCKETS``): the buckets read from the store, the
missing ones filled, the window's uneven edges queried. The panel's own (``QUERY``): one
query over the whole window. Which costs less depends on the engine. Where a query's
cost follows the documents it matches (MongoDB, FerretDB 2 on an index), the edges cost
a small part of the window and the cache wins. Where a query costs about the same
whatever its range, or the engine cannot group by bucket (nx-27017), the cache's two
queries cost more than the panel's one, as Cortex's query-frontend found of its own
splits.

So the choice is measured as the panel runs, never taken from the engine's name
(:class:`PlanChooser`): each plan's time per window, an exponentially weighted mean,
and the cheaper plan answers. The cache's plan goes first, for a few windows, so that
its cost is measured warm and not only by the call that filled the buckets; then one
window tries the panel's query. From then on the plan not chosen is tried again by one
window per ``cache.replan_ms``, so that a change (the cache warmed, the engine loaded,
an index built) is seen, at the cost of one window in that time.

A window's time is the engine's work and the waits for it as this server sees them, not
the engine's work alone: on an engine the panels' queries keep busy, a window of the
buckets waits as long as one of the query, and while the query answers, the buckets are
not kept warm, so each try of them finds buckets to fill. The dashboard bench found it
choosing the query on FerretDB 2, where the buckets cost far less: so it is chosen by
``cache.plan = "measured"``, not by default.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from lookups.clock import SYSTEM_CLOCK

__all__ = ["Plan", "PlanChooser"]

T = TypeVar("T")

#: Windows the cache's plan answers before the panel's query is tried: the first fills
#: the buckets, the next ones show what a warm window costs.
FIRST_BUCKET_WINDOWS = 3
#: The weight of a new window's time in its plan's mean.
_WEIGHT = 0.3


class Plan(Enum):
    """How a cached panel answers a window."""

    BUCKETS = "buckets"  # the cached buckets and a query of the edges
    QUERY = "query"  # the panel's own query over the whole window


class PlanChooser:
    """The plan of each window of one panel, by the measured time of each plan.

    :meth:`answer` answers a window by the plan :meth:`choose` names, and tells
    :meth:`record` what it took. Not thread-safe: one event loop's greenlets share it, as
    they share the panel.
    """

    def __init__(
        self, replan_s: float, clock: Callable[[], float] = SYSTEM_CLOCK.monotonic
    ) -> None:
        """``replan_s``: how often the plan not chosen is tried again; ``clock``:
        monotonic seconds."""
        self._replan_s = replan_s
        self._clock = clock
        self._mean_s: dict[Plan, float] = {}
        self._bucket_windows = 0
        self._measured_at: dict[Plan, float] = {}
        self._trying: Plan | None = None

    @property
    def chosen(self) -> Plan:
        """The plan that measured cheaper (the cache's until both are measured)."""
        buckets, query = self._mean_s.get(Plan.BUCKETS), self._mean_s.get(Plan.QUERY)
        if buckets is None or query is None or buckets <= query:
            return Plan.BUCKETS
        return Plan.QUERY

    def mean_s(self, plan: Plan) -> float | None:
        """``plan``'s mean time per window, None until it answered one."""
        return self._mean_s.get(plan)

    def choose(self) -> Plan:
        """The plan of the next window: the cheaper one, or the other once its last window
        is ``replan_s`` old (one window at a time tries it)."""
        if self._bucket_windows < FIRST_BUCKET_WINDOWS:
            return Plan.BUCKETS
        chosen = self.chosen
        other = Plan.QUERY if chosen is Plan.BUCKETS else Plan.BUCKETS
        if self._trying is None:
            now = self._clock()
            measured_at = self._measured_at.get(other)
            if measured_at is None or now - measured_at >= self._replan_s:
                self._trying, self._measured_at[other] = other, now
                return other
        return chosen

    def answer(self, by_plan: Callable[[Plan], T]) -> T:
        """``by_plan(plan)`` for the plan :meth:`choose` names, timed and recorded."""
        plan = self.choose()
        started = self._clock()
        answered = False
        try:
            value = by_plan(plan)
            answered = True
            return value
        finally:
            self.record(plan, self._clock() - started, answered=answered)

    def record(self, plan: Plan, elapsed_s: float, *, answered: bool = True) -> None:
        """Window answered by ``plan`` in ``elapsed_s``. A window that failed
        (``answered=False``) can make its plan look dearer, never cheaper: a quick failure
        says nothing of what an answer costs."""
        if self._trying is plan:
            self._trying = None
        self._measured_at[plan] = self._clock()
        mean = self._mean_s.get(plan)
        if not answered:
            if mean is None or elapsed_s <= mean:
                return
        elif plan is Plan.BUCKETS:
            self._bucket_windows += 1
        # The first windows warm the cache, and a trial's window is the only recent word
        # on its plan: the newest of either replaces the mean.
        warming = plan is Plan.BUCKETS and self._bucket_windows <= FIRST_BUCKET_WINDOWS
        if mean is None or warming or plan is not self.chosen:
            self._mean_s[plan] = elapsed_s
        else:
            self._mean_s[plan] = mean + _WEIGHT * (elapsed_s - mean)
