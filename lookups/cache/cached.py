"""A MongoDB panel answered from cached buckets plus a query for the window's edges.

:class:`CachedLookup` wraps a panel's own lookup. For a window it plans the aligned,
settled buckets inside it (:mod:`lookups.cache.buckets`) and reads their parts from the
store (or their sum, :mod:`lookups.cache.merged`). It fills the missing ones with one
query (:mod:`lookups.cache.fills`), shared with every caller missing the same buckets
meanwhile: all of them where the engine groups by bucket, else the newest few, the
others then queried as ranges with the uneven edges, so that no call costs much more
than the panel's one query and each refresh warms the cache further. The sum of the
parts goes to the panel (:mod:`lookups.mongo_parts`). A window with no whole settled
bucket, or whose parts cannot be kept whole, is answered by the panel's own query. So,
with ``cache.plan = "measured"``, is every window while that query costs less than the
buckets on this engine, each timed alone on it (:mod:`lookups.cache.plans`). The store never
fails a call: what it cannot give is queried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from opentelemetry import trace

from lookups.cache.buckets import BucketPlan, bucket_runs, plan_buckets
from lookups.cache.fills import fill_faceted, fill_grouped
from lookups.cache.merged import MergedRun, MergedRuns
from lookups.cache.panel import CachedPanel
from lookups.cache.plans import TIMING_BUDGET_S, Plan, PlanChooser
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import BucketStore
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.mongo import QUERY_GROUP_CAP, MongoLookup, aggregate_one_batch, first_batch
from lookups.mongo_parts import (
    NoPart,
    PanelParts,
    Part,
    add_parts,
    decode_part,
    encode_part,
    ranges_filter,
    subtract_part,
)
from lookups.panels import PanelValue, Window
from tracing.spans import timing_span

__all__ = ["CachedLookup", "FILL_FACETS", "KEY_VERSION"]

T = TypeVar("T")

#: Buckets a call fills where the engine does not group by bucket (one ``$facet`` each,
#: in one query). A facet filters every document of the query's range, so such a fill
#: costs about its buckets squared.
FILL_FACETS = 2
#: Part of every key: a change of the parts' layout starts on fresh keys.
KEY_VERSION = "v1"
#: Apps remembered as dense at most; beyond, the memory starts again.
_DENSE_APPS = 1024


class CachedLookup(CachedPanel):
    """``inner``'s panel from cached buckets; ``inner`` itself answers fresh calls."""

    def __init__(
        self,
        inner: MongoLookup,
        parts: PanelParts,
        store: BucketStore,
        settings: CacheSettings,
        namespace: str,
        merged: MergedRuns,
        chooser: PlanChooser | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``chooser`` picks each window's plan (:mod:`lookups.cache.plans`); without one,
        every window is answered from the buckets."""
        super().__init__(
            inner,
            store,
            settings,
            f"fanout:{KEY_VERSION}:{namespace}:{inner.name}:{settings.bucket_ms}",
            clock,
        )
        self.inner: MongoLookup = inner
        self._parts, self._merged = parts, merged
        self.chooser = chooser
        #: Whether the engine groups by bucket (one query fills them all): None until tried.
        self._grouped: bool | None = None
        #: Ranges read as rows at most this long together: a window's two uneven edges.
        self._rows_span_ms = 2 * settings.bucket_ms + settings.settle_ms
        #: Apps whose edges held more rows than one batch, until when they are grouped.
        self._dense: dict[str, float] = {}

    def fetch(self, window: Window, deadline: Deadline) -> PanelValue:
        plan = plan_buckets(
            window.start_ms, window.end_ms, self._bucket_ms, self._settled_before_ms()
        )
        if not plan.buckets:
            return self.inner.fetch(window, deadline)
        if self.chooser is None:
            return self._from_buckets(window, plan, deadline)
        return self.chooser.answer(
            partial(self._by_plan, window, plan, deadline), partial(self._timing, window, plan)
        )

    def _by_plan(
        self, window: Window, plan: BucketPlan, deadline: Deadline, chosen: Plan
    ) -> PanelValue:
        """The window by ``chosen``, for its caller."""
        trace.get_current_span().set_attribute("fanout.cache.plan", chosen.value)
        if chosen is Plan.QUERY:
            self.store.stats.query_windows += 1
            return self.inner.fetch(window, deadline)
        return self._from_buckets(window, plan, deadline)

    def _timing(self, window: Window, plan: BucketPlan, chosen: Plan) -> None:
        """The window by ``chosen``, for no caller: to time it (:mod:`lookups.cache.plans`)."""
        deadline = Deadline.after_s(TIMING_BUDGET_S, self.inner.backend.clock)
        with timing_span(self.name, chosen.value):
            if chosen is Plan.QUERY:
                self.inner.fetch(window, deadline)
            else:
                self._from_buckets(window, plan, deadline)

    def _from_buckets(self, window: Window, plan: BucketPlan, deadline: Deadline) -> PanelValue:
        """The window from the cached buckets, the missing ones filled, and its edges."""
        run = (self.name, window.app, plan.buckets[0], plan.buckets[-1])
        try:
            known = self._merged.get(run)
            if known is None and not self.store.available():
                self.store.stats.direct += 1  # the store is down: the panel's own query, no fill
                return self.inner.fetch(window, deadline)
            if known is None:
                known = self._shifted(window.app, run, deadline)
            if known is not None:
                parts, unread = [known.total], list[int]()  # every bucket known
                self._counted(len(plan.buckets), 0)
            else:
                parts, unread = self._bucket_parts(window.app, plan, deadline)
                if not unread:
                    known = self._merged.put(run, add_parts(parts), self._parts)
                    parts = [known.total]
            ranges = bucket_runs(unread, self._bucket_ms) + list(plan.edges)
            rest: Part = {}
            if ranges:
                rest = self._shared(
                    ("rest", window.app, tuple(sorted(ranges))),
                    deadline,
                    lambda: self._query(window.app, ranges, deadline),
                )
            if known is not None and self._parts.finish_reads_ranked_only:
                # A window's sum is its kept run's (thousands of groups) plus its edges': only
                # the groups that can rank are added up, not a copy of them all.
                top = known.top_with(rest)
                if top is not None:
                    return self._parts.finish(top, self._parts.ranked_keys(top))
            total = add_parts([*parts, rest])
            return self._parts.finish(total, known.ranked_with(total, rest) if known else None)
        except NoPart:
            self.store.stats.direct += 1
            return self.inner.fetch(window, deadline)

    def _shifted(
        self, app: str, run: tuple[str, str, int, int], deadline: Deadline
    ) -> MergedRun | None:
        """The sum of ``run`` from a kept run one bucket shorter or longer at one end (a
        sliding window crossed a boundary): that sum plus or minus one bucket, not 96."""
        _, _, first, last = run
        step = self._bucket_ms
        for previous, start, adding in (
            ((self.name, app, first, last - step), last, True),
            ((self.name, app, first - step, last), first - step, False),
        ):
            old = self._merged.get(previous)
            if old is None:
                continue
            found = self.store.get_many([self.key(app, start)])
            part = decode_part(found[self.key(app, start)]) if found else None
            missing = int(part is None)
            self._counted((last - first) // step + 1 - missing, missing)
            if part is None:
                edge = (start,)
                part = self._shared(
                    ("fill", app, edge), deadline, partial(self._fill, app, edge, deadline)
                )[start]
            # A sliding window does not come back to the run it left: its room goes to the
            # runs still asked for (at a boundary every app's run moves on at once).
            self._merged.discard(previous)
            if adding:  # the kept ranking and the bucket's groups are the candidates
                total = add_parts([old.total, part])
                return self._merged.put(run, total, self._parts, old.ranked_with(total, part))
            return self._merged.put(run, subtract_part(old.total, part), self._parts)
        return None

    @property
    def groups_by_bucket(self) -> bool | None:
        """Whether the engine groups by bucket, so that one query fills every missing
        bucket (MongoDB, FerretDB 2); None until a fill has tried."""
        return self._grouped

    def _bucket_parts(
        self, app: str, plan: BucketPlan, deadline: Deadline
    ) -> tuple[list[Part], list[int]]:
        """The parts found or filled now, and the starts of the buckets neither."""
        keys = [self.key(app, start) for start in plan.buckets]
        found = self.store.get_many(keys)
        parts, missing = [], []
        for start, key in zip(plan.buckets, keys):
            part = decode_part(found[key]) if key in found else None
            if part is None:
                missing.append(start)
            else:
                parts.append(part)
        self._counted(len(parts), len(missing))
        # All of them where the engine groups by bucket; else the newest few, which stay in
        # a sliding window longest.
        filling = tuple(missing if self._grouped is not False else missing[-FILL_FACETS:])
        filled: dict[int, Part] = {}
        if filling:
            filled = self._shared(
                ("fill", app, filling), deadline, lambda: self._fill(app, filling, deadline)
            )
            parts.extend(filled.values())
        return parts, [start for start in missing if start not in filled]

    def _fill(self, app: str, starts: tuple[int, ...], deadline: Deadline) -> dict[int, Part]:
        """Query the parts of the buckets at ``starts`` (or of the newest few, where the
        engine does not group by bucket) and store them."""

        def aggregate(pipeline: list[dict[str, Any]]) -> list[Any]:
            return self._aggregate(pipeline, deadline)

        found = None
        if self._grouped is not False and starts[0] >= 0:
            found = fill_grouped(self._parts, aggregate, app, starts, self._bucket_ms)
            self._grouped = found is not None
        if found is None:
            starts = starts[-FILL_FACETS:]
            found = fill_faceted(self._parts, aggregate, app, starts, self._bucket_ms)
        filled = dict(zip(starts, found))
        self.store.put_many(
            {self.key(app, start): encode_part(part) for start, part in filled.items()}
        )
        self.store.stats.fills += len(filled)
        return filled

    def _query(self, app: str, ranges: Sequence[tuple[int, int]], deadline: Deadline) -> Part:
        """The part of ``ranges``: short ones (the edges of a warm window) read as rows and
        grouped here, where the engine's ``$group`` (or ``$limit``) costs far more than the
        few documents (on FerretDB 2 each opens a PostgreSQL connection: the manual's
        docs/explanation/results-cache.md); an app with more rows than one batch there is
        grouped by the engine for a bucket's time."""
        match = {"$match": ranges_filter(app, ranges)}
        if (
            sum(end - start for start, end in ranges) <= self._rows_span_ms
            and self._dense.get(app, 0.0) <= self._clock.wall()
        ):
            rows, whole = self._run(
                lambda db: first_batch(
                    db, self.inner.collection, [match, *self._parts.row_stages()], QUERY_GROUP_CAP
                ),
                deadline,
            )
            if whole:
                return self._parts.part_of_rows(rows)
            if len(self._dense) >= _DENSE_APPS:
                self._dense.clear()
            self._dense[app] = self._clock.wall() + self._bucket_ms / 1000
        return self._parts.part(self._aggregate([match, *self._parts.stages()], deadline))

    def _aggregate(self, pipeline: list[dict[str, Any]], deadline: Deadline) -> list[Any]:
        collection = self.inner.collection
        return self._run(lambda db: aggregate_one_batch(db, collection, pipeline), deadline)

    def _run(self, operation: Callable[[Any], T], deadline: Deadline) -> T:
        result: T = self.inner.backend.run(self.name, operation, deadline)
        return result
