"""Which plan answers a cached panel's windows, chosen by what each costs on this engine.

A window has two plans. The cache's (``BUCKETS``): the buckets read from the store, the
missing ones filled, the window's uneven edges queried. The panel's own (``QUERY``): one
query over the whole window. Which costs less depends on the engine. Where a query's
cost follows the documents it matches and the engine groups by bucket (MongoDB,
FerretDB 2 on an index), the edges cost a small part of the window and the cache wins.
Where the engine cannot fill many buckets in one query (nx-27017), filling them costs
more than the panel's one query, as Cortex's query-frontend found of its own splits.

So the choice is measured as the panel runs, never taken from the engine's name
(:class:`PlanChooser`), by **paired probes**: once per ``cache.replan_ms``, one window
is answered by the chosen plan and then run by the other too, back to back, each timed.
The ratio of the two times (buckets over query) says which costs less *at that moment*:
both wait behind the same load, so the engine's queue, a busy event loop or a slow
network weigh on both, where a comparison of windows answered minutes apart measured the
load as much as the plan. The median of the last few ratios chooses; the cache's plan
answers until the first probe, and wherever the two cost the same. A probe of the
buckets fills what they lack, as their window would, so it measures what going back to
the buckets costs now, cold buckets included, and warms them for the next probe.

What a probe costs: one window in ``replan_ms`` runs both plans, and its caller waits
for both; nothing else is added. The other plan's failure (its own deadline, an engine
error) fails nothing: that probe gives no ratio.

Where it is wrong: on an engine that runs many queries side by side (FerretDB 2 on
PostgreSQL), a query's time under load is mostly its wait, not what the engine spends
on it, and the dashboard bench found the probes choosing the query there too, where the
buckets cost the database far less. Hence ``cache.plan = "measured"`` is not the default.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from lookups.clock import SYSTEM_CLOCK

__all__ = ["Plan", "PlanChooser", "ByPlan"]

T = TypeVar("T")

#: Windows the cache's plan answers before the first probe: the first fills the
#: buckets, the next ones find them warm, as a dashboard's refreshes do.
FIRST_BUCKET_WINDOWS = 3
#: Probes whose ratios the choice takes the median of: one slow moment does not flip it.
PROBES_KEPT = 5


class Plan(Enum):
    """How a cached panel answers a window."""

    BUCKETS = "buckets"  # the cached buckets and a query of the edges
    QUERY = "query"  # the panel's own query over the whole window


#: Runs a window by ``plan``; ``probe`` is True for the plan run beside the answer.
ByPlan = Callable[[Plan, bool], T]


class PlanChooser:
    """The plan of each window of one panel, by paired probes of both plans.

    :meth:`answer` answers a window. Not thread-safe: one event loop's greenlets share
    it, as they share the panel.
    """

    def __init__(
        self, replan_s: float, clock: Callable[[], float] = SYSTEM_CLOCK.monotonic
    ) -> None:
        """``replan_s``: how often a window probes both plans; ``clock``: monotonic
        seconds."""
        self._replan_s = replan_s
        self._clock = clock
        self._ratios: deque[float] = deque(maxlen=PROBES_KEPT)
        self._bucket_windows = 0
        self._probed_at: float | None = None
        #: Probes made, and those of which the other plan failed (no ratio).
        self.probes = 0
        self.probes_failed = 0

    @property
    def ratio(self) -> float | None:
        """The median of the kept probes' buckets-over-query times; None before the first."""
        return statistics.median(self._ratios) if self._ratios else None

    @property
    def chosen(self) -> Plan:
        """The plan the probes found cheaper (the cache's until then, and on a tie)."""
        ratio = self.ratio
        return Plan.QUERY if ratio is not None and ratio > 1.0 else Plan.BUCKETS

    def answer(self, by_plan: ByPlan[T]) -> T:
        """``by_plan(plan, False)`` for the chosen plan; on a probe's window, then
        ``by_plan(other, True)`` too, both timed."""
        chosen = self.chosen
        if not self._probe_due(chosen):
            value = by_plan(chosen, False)
            if chosen is Plan.BUCKETS:
                self._bucket_windows += 1
            return value
        self._probed_at = self._clock()
        self.probes += 1
        started = self._clock()
        value = by_plan(chosen, False)
        chosen_s = self._clock() - started
        other = Plan.QUERY if chosen is Plan.BUCKETS else Plan.BUCKETS
        started = self._clock()
        try:
            by_plan(other, True)
        except Exception:  # noqa: BLE001 - the caller has its answer: the probe gives no ratio
            self.probes_failed += 1
            return value
        self.record(chosen, chosen_s, other, self._clock() - started)
        return value

    def record(self, first: Plan, first_s: float, second: Plan, second_s: float) -> None:
        """A probe: ``first`` took ``first_s``, ``second`` (the other plan) ``second_s``."""
        buckets_s, query_s = (first_s, second_s) if first is Plan.BUCKETS else (second_s, first_s)
        if query_s > 0:
            self._ratios.append(buckets_s / query_s)
        else:  # below the clock's tick: the query is the cheaper unless both were
            self._ratios.append(float("inf") if buckets_s > 0 else 1.0)

    def _probe_due(self, chosen: Plan) -> bool:
        if self._probed_at is None:
            return chosen is Plan.BUCKETS and self._bucket_windows >= FIRST_BUCKET_WINDOWS
        return self._clock() - self._probed_at >= self._replan_s
