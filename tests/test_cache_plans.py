"""Each window's plan, the cached buckets or the panel's own query, by what each measured.

The chooser alone with a clock moved by hand; then a cached panel on the seeded
MongoDB-wire server behind a proxy that makes every command slow, where the buckets
either cost more than the query (a cache that keeps nothing) or nothing at all (warm).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import gevent
import pytest
from gevent.event import Event
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import MongoBackendSettings
from lookups.cache.cached import CachedLookup
from lookups.cache.plans import (
    MAX_REPLAN_FACTOR,
    PROBE_ATTEMPTS,
    QUIET_WAIT_S,
    TIMINGS_KEPT,
    Plan,
    PlanChooser,
)
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import CacheStats, MemoryStore
from lookups.cache.wiring import with_cache
from lookups.deadline import Deadline
from lookups.mongo import ErrorsLookup
from lookups.panels import Window
from service.samples import MongoWireServer
from service.samples.faults import TcpFaultProxy
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from service.testing import FakeClock
from tests.support.panels import close_panels
from tests.support.samples import SAMPLE_DATABASE

HOUR_MS = 3_600_000
UNEVEN = Window("shop", SAMPLE_START_MS + 1_234_000, SAMPLE_END_MS - 2_345_000)
DAY = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
# Every command this much later: the plans' times are then their round trips, whatever
# else the machine is doing.
COMMAND_DELAY_MS = 200


class Use:
    """What the engine has in flight, as the backend's counter says it: a test sets it."""

    def __init__(self) -> None:
        self.idle = Event()
        self.idle.set()
        self.overlaps = 0


class Engine:
    """Runs a window by a plan in the time ``times`` gives it, on a clock moved by hand;
    ``failing``: the plans that raise instead; ``crowding``: runs that another operation
    overlaps, the next ones first."""

    def __init__(self, clock: FakeClock, times: dict[Plan, float], use: Use) -> None:
        self.clock, self.times, self.use = clock, times, use
        self.failing: set[Plan] = set()
        self.crowding = 0
        self.runs: list[tuple[Plan, bool]] = []

    def answer(self, plan: Plan) -> str:
        return self._run(plan, False)

    def timing(self, plan: Plan) -> str:
        return self._run(plan, True)

    def _run(self, plan: Plan, timing: bool) -> str:
        self.runs.append((plan, timing))
        self.clock.advance(self.times[plan])
        if timing and self.crowding:
            self.crowding -= 1
            self.use.overlaps += 1  # a call's operation began meanwhile
        if plan in self.failing:
            raise TimeoutError(f"{plan.value} ran out of time")
        return plan.value


def _windows(chooser: PlanChooser, engine: Engine, count: int) -> list[str]:
    """Answer ``count`` windows, a second apart, each timing run to its end; the plan of
    each answer."""
    answers = []
    for _ in range(count):
        answers.append(chooser.answer(engine.answer, engine.timing))
        chooser.join_timing()
        engine.clock.advance(1.0)
    return answers


def _chooser(times: dict[Plan, float]) -> tuple[PlanChooser, Engine]:
    clock, use = FakeClock(), Use()
    return PlanChooser(60.0, use, CacheStats(), clock), Engine(clock, times, use)


def test_the_query_answers_first_then_a_timing_warms_and_times_both_and_the_cheaper_answers() -> (
    None
):
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    answers = _windows(chooser, engine, 4)
    assert answers == ["query"] + ["buckets"] * 3
    assert engine.runs[:4] == [
        (Plan.QUERY, False),
        (Plan.BUCKETS, True),  # the buckets filled, untimed
        (Plan.QUERY, True),
        (Plan.BUCKETS, True),
    ]
    assert chooser.ratio == pytest.approx(0.25) and chooser.stats.timings == 1


def test_buckets_as_dear_as_the_query_answer_nothing() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.2, Plan.QUERY: 0.2})
    assert set(_windows(chooser, engine, 5)) == {"query"}
    assert chooser.chosen is Plan.QUERY and chooser.ratio == pytest.approx(1.0)


def test_timings_that_agree_come_ever_later_and_a_change_brings_them_back() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.22, Plan.QUERY: 0.2})  # close: 1.1
    timed_at = []
    for _ in range(150):  # a window about every 10 s
        timings = chooser.stats.timings
        _windows(chooser, engine, 1)
        if chooser.stats.timings > timings:
            timed_at.append(engine.clock.monotonic())
        engine.clock.advance(9.0)
    gaps = [later - earlier for earlier, later in pairwise(timed_at)]
    most = 60.0 * MAX_REPLAN_FACTOR
    periods = [66.0, 132.0, 264.0, most, most]  # 1.1 periods first: the plans' ratio
    assert len(gaps) == len(periods)
    assert all(period <= gap < period + 12 for gap, period in zip(gaps, periods))
    engine.times[Plan.BUCKETS] = 0.19  # the buckets got a little cheaper: the choice changes
    engine.clock.advance(chooser.period_s)
    for _ in range(TIMINGS_KEPT // 2 + 1):  # until they are most of the kept ratios
        assert chooser.chosen is Plan.QUERY
        _windows(chooser, engine, 1)
        engine.clock.advance(chooser.period_s)
    assert chooser.chosen is Plan.BUCKETS
    assert chooser.period_s == pytest.approx(60.0 / 0.95)


def test_plans_far_apart_alone_put_the_next_timing_far_off_and_under_load_do_not() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 2.0, Plan.QUERY: 0.2})  # ten times dearer
    _windows(chooser, engine, 1)
    assert chooser.chosen is Plan.QUERY and chooser.period_s == 60.0 * MAX_REPLAN_FACTOR
    crowded, engine = _chooser({Plan.BUCKETS: 2.0, Plan.QUERY: 0.2})
    engine.crowding = 1_000  # never alone: timed under load, less sure
    _windows(crowded, engine, 1)
    assert crowded.stats.timings_crowded == 1 and crowded.period_s == 60.0


def test_one_window_a_replan_period_timings_and_the_median_of_the_timings_chooses() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.4, Plan.QUERY: 0.2})
    _windows(chooser, engine, 1)  # one timing: the query stays, the next in two periods
    assert chooser.period_s == pytest.approx(120.0)
    engine.runs.clear()
    engine.times[Plan.BUCKETS] = 0.05  # the buckets got cheaper
    _windows(chooser, engine, 20)
    assert engine.runs == [(Plan.QUERY, False)] * 20  # within the period: no timing
    engine.clock.advance(chooser.period_s)
    assert _windows(chooser, engine, 2) == ["query", "query"]  # ratios 2 and 0.25
    assert engine.runs[20:24] == [
        (Plan.QUERY, False),
        (Plan.QUERY, True),
        (Plan.BUCKETS, True),
        (Plan.QUERY, False),
    ]
    assert chooser.ratio == pytest.approx(1.125)  # their median: still the query
    assert chooser.period_s == pytest.approx(240.0)  # the choice stayed: twice the last period
    engine.clock.advance(chooser.period_s)
    assert _windows(chooser, engine, 2) == ["query", "buckets"]  # a third: 0.25
    assert chooser.stats.timings == 3 and chooser.chosen is Plan.BUCKETS


def test_one_slow_timing_does_not_flip_the_choice() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    for _ in range(3):
        _windows(chooser, engine, 1)
        engine.clock.advance(chooser.period_s)
    engine.times[Plan.BUCKETS] = 2.0  # a moment the buckets waited for long
    _windows(chooser, engine, 1)
    assert chooser.stats.timings == 4 and chooser.chosen is Plan.BUCKETS


def test_a_timing_waits_until_the_engine_is_alone_and_no_caller_waits_for_it() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.use.idle.clear()  # a call's operation in flight
    assert chooser.answer(engine.answer, engine.timing) == "query"
    gevent.sleep(0)
    assert engine.runs == [(Plan.QUERY, False)]  # waiting, unseen
    engine.clock.advance(QUIET_WAIT_S / 2)
    assert engine.runs == [(Plan.QUERY, False)] and chooser.stats.timings_running == 1
    engine.use.idle.set()
    chooser.join_timing()
    assert chooser.stats.timings_running == 0
    assert engine.runs[1:] == [(Plan.BUCKETS, True), (Plan.QUERY, True), (Plan.BUCKETS, True)]
    assert chooser.chosen is Plan.BUCKETS


def test_a_run_another_operation_overlapped_is_not_counted_and_the_timing_tries_again() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.crowding = 3  # the filling run, then the first two attempts' queries
    _windows(chooser, engine, 1)
    timings = [plan for plan, timing in engine.runs if timing]
    assert timings == [Plan.BUCKETS, Plan.QUERY, Plan.QUERY, Plan.QUERY, Plan.BUCKETS]
    assert chooser.ratio == pytest.approx(0.25) and chooser.stats.timings_crowded == 0


def test_a_timing_never_alone_times_both_plans_under_load_on_its_last_try() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.4, Plan.QUERY: 0.2})
    engine.crowding = 1_000
    _windows(chooser, engine, 1)
    timings = [plan for plan, timing in engine.runs if timing]
    # The buckets filled; each try stops at its first plan overlapped; the last runs both.
    assert timings == [Plan.BUCKETS] + [Plan.QUERY] * PROBE_ATTEMPTS + [Plan.BUCKETS]
    assert (chooser.stats.timings, chooser.stats.timings_crowded, chooser.chosen) == (
        1,
        1,
        Plan.QUERY,
    )
    assert chooser.ratio == pytest.approx(2.0)


def test_an_engine_never_idle_is_timed_under_load_once_the_wait_for_quiet_ends() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.use.idle.clear()  # this process always has an operation there
    chooser.answer(engine.answer, engine.timing)
    gevent.sleep(0)
    for _ in range(2):  # the wait to fill the buckets, then the wait to time both plans
        engine.clock.advance(QUIET_WAIT_S - 0.5)
        gevent.sleep(0)
        assert chooser.ratio is None  # still waiting for a quiet moment
        engine.clock.advance(1.0)
        gevent.sleep(0)
    chooser.join_timing()
    assert [run for run in engine.runs if run[1]] == [
        (Plan.BUCKETS, True),
        (Plan.QUERY, True),
        (Plan.BUCKETS, True),
    ]
    assert chooser.chosen is Plan.BUCKETS and chooser.stats.timings_crowded == 1


def test_the_other_plans_failure_fails_nothing_and_gives_no_ratio() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.failing.add(Plan.BUCKETS)
    assert _windows(chooser, engine, 3) == ["query"] * 3
    assert (chooser.stats.timings, chooser.stats.timings_failed, chooser.ratio) == (1, 1, None)


def test_the_chosen_plans_failure_is_the_callers_and_starts_no_timing() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.failing.add(Plan.QUERY)
    with pytest.raises(TimeoutError):
        chooser.answer(engine.answer, engine.timing)
    chooser.join_timing()
    assert engine.runs == [(Plan.QUERY, False)] and chooser.stats.timings == 0


@pytest.fixture
def slow_mongo(mongo_server: MongoWireServer) -> Iterator[tuple[MongoBackend, TcpFaultProxy]]:
    with TcpFaultProxy(("127.0.0.1", mongo_server.port)) as proxy:
        uri = f"mongodb://127.0.0.1:{proxy.address[1]}/?directConnection=true"
        backend = MongoBackend("mongo", MongoBackendSettings(uri=uri, database=SAMPLE_DATABASE))
        yield backend, proxy
        backend.close()


def _errors(backend: MongoBackend, max_bytes: int, plan: str) -> CachedLookup:
    settings = CacheSettings(
        enabled=True, bucket_ms=HOUR_MS, settle_ms=0, max_bytes=max_bytes, plan=plan
    )
    lookup = with_cache({"errors": ErrorsLookup(backend)}, settings, MemoryStore(max_bytes))
    assert isinstance(lookup["errors"], CachedLookup)
    return lookup["errors"]


def _fetch(lookup: CachedLookup, window: Window) -> Any:
    return lookup.fetch(window, Deadline.after_ms(30_000))


def _windows_of(lookup: CachedLookup, window: Window, count: int) -> list[Any]:
    """``count`` answers of ``window``, each timing it starts run to its end before the next."""
    assert lookup.chooser is not None
    answers = []
    for _ in range(count):
        answers.append(_fetch(lookup, window))
        lookup.chooser.join_timing()
    return answers


def test_buckets_dearer_than_the_query_send_the_windows_to_the_query(slow_mongo: Any) -> None:
    backend, proxy = slow_mongo
    lookup = _errors(backend, 0, "measured")  # keeps nothing: each window fills and queries
    expected = lookup.inner.fetch(UNEVEN, Deadline.after_ms(30_000))
    proxy.set_delay_ms(COMMAND_DELAY_MS)
    answers = _windows_of(lookup, UNEVEN, 4)
    assert lookup.chooser is not None and lookup.chooser.chosen is Plan.QUERY
    assert lookup.chooser.ratio is not None and lookup.chooser.ratio > 1.0
    assert lookup.chooser.stats.timings == 1 and lookup.chooser.stats.timings_crowded == 0
    assert lookup.store.stats.query_windows == 4  # every answer: the buckets never won
    assert all(close_panels(answer, expected) for answer in answers)


def test_warm_buckets_cheaper_than_the_query_keep_the_windows(slow_mongo: Any) -> None:
    backend, proxy = slow_mongo
    lookup = _errors(backend, 1 << 24, "measured")
    chooser, lookup.chooser = lookup.chooser, None  # warmed from the buckets alone
    for _ in range(24):  # nx-27017 fills a few buckets a window; FerretDB 2 all at once
        expected = _fetch(lookup, DAY)
    lookup.chooser = chooser
    stats = lookup.store.stats
    misses = stats.misses
    proxy.set_delay_ms(COMMAND_DELAY_MS)
    answers = _windows_of(lookup, DAY, 4)
    assert chooser is not None and chooser.chosen is Plan.BUCKETS and chooser.stats.timings == 1
    # The first answer, before the timing, was the query's; the timing and the buckets since
    # missed nothing.
    assert stats.query_windows == 1 and stats.misses == misses
    assert all(close_panels(answer, expected) for answer in answers)


def test_a_timing_is_a_trace_of_its_own_and_times_each_plan_alone(
    slow_mongo: Any, spans: InMemorySpanExporter
) -> None:
    backend, proxy = slow_mongo
    lookup = _errors(backend, 0, "measured")
    proxy.set_delay_ms(COMMAND_DELAY_MS)
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("caller") as caller:
        _fetch(lookup, UNEVEN)
        assert lookup.chooser is not None and lookup.chooser.stats.timings == 1
        busy = gevent.spawn(_fetch, lookup, DAY)  # a caller's window as the timing starts
        busy.get()
    lookup.chooser.join_timing()
    # The caller's operations overlapped the timing: what they overlapped was not timed.
    assert backend.engine_use.overlaps > 0
    assert lookup.chooser.ratio is not None and lookup.chooser.stats.timings_failed == 0
    timings = [span for span in spans.get_finished_spans() if span.name.startswith("fanout.cache")]
    assert {(span.attributes or {}).get("fanout.cache.timing") for span in timings} == {
        "buckets",
        "query",
    }
    assert len(timings) >= 3  # the buckets filled, then both plans alone
    trace_id = caller.get_span_context().trace_id
    assert all(span.parent is None and span.context.trace_id != trace_id for span in timings)
