"""Each window's plan, the cached buckets or the panel's own query, by what each measured.

The chooser alone with a clock moved by hand; then a cached panel on the seeded
MongoDB-wire server behind a proxy that makes every command slow, where the buckets
either cost more than the query (a cache that keeps nothing) or nothing at all (warm).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import MongoBackendSettings
from lookups.cache import CacheSettings, with_cache
from lookups.cache.cached import CachedLookup
from lookups.cache.plans import FIRST_BUCKET_WINDOWS, Plan, PlanChooser
from lookups.cache.stores import MemoryStore
from lookups.deadline import Deadline
from lookups.mongo import ErrorsLookup
from lookups.panels import Window
from service.samples import MongoWireServer
from service.samples.faults import TcpFaultProxy
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.clock import FakeClock
from tests.support.panels import close_panels
from tests.support.samples import SAMPLE_DATABASE

HOUR_MS = 3_600_000
UNEVEN = Window("shop", SAMPLE_START_MS + 1_234_000, SAMPLE_END_MS - 2_345_000)
DAY = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
# Every command this much later: the plans' times are then their round trips, whatever
# else the machine is doing.
COMMAND_DELAY_MS = 200


class Engine:
    """Runs a window by a plan in the time ``times`` gives it, on a clock moved by hand;
    ``failing``: the plans that raise instead."""

    def __init__(self, clock: FakeClock, times: dict[Plan, float]) -> None:
        self.clock, self.times = clock, times
        self.failing: set[Plan] = set()
        self.runs: list[tuple[Plan, bool]] = []

    def __call__(self, plan: Plan, probe: bool) -> str:
        self.runs.append((plan, probe))
        self.clock.advance(self.times[plan])
        if plan in self.failing:
            raise TimeoutError(f"{plan.value} ran out of time")
        return plan.value


def _windows(chooser: PlanChooser, engine: Engine, count: int) -> list[str]:
    """Answer ``count`` windows, a second apart; the plan of each answer."""
    answers = []
    for _ in range(count):
        answers.append(chooser.answer(engine))
        engine.clock.advance(1.0)
    return answers


def _chooser(times: dict[Plan, float]) -> tuple[PlanChooser, Engine]:
    clock = FakeClock()
    return PlanChooser(60.0, clock.monotonic), Engine(clock, times)


def test_the_buckets_answer_first_then_a_probe_runs_both_and_the_cheaper_answers() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.4, Plan.QUERY: 0.2})
    answers = _windows(chooser, engine, FIRST_BUCKET_WINDOWS + 4)
    assert answers == ["buckets"] * (FIRST_BUCKET_WINDOWS + 1) + ["query"] * 3
    probe = FIRST_BUCKET_WINDOWS  # the window after the first ones runs both, buckets first
    assert engine.runs[probe : probe + 2] == [(Plan.BUCKETS, False), (Plan.QUERY, True)]
    assert chooser.ratio == pytest.approx(2.0) and chooser.probes == 1


def test_buckets_as_cheap_as_the_query_keep_answering() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.2, Plan.QUERY: 0.2})
    assert set(_windows(chooser, engine, FIRST_BUCKET_WINDOWS + 4)) == {"buckets"}
    assert chooser.chosen is Plan.BUCKETS and chooser.ratio == pytest.approx(1.0)


def test_one_window_a_replan_period_probes_and_the_median_of_the_probes_chooses() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.4, Plan.QUERY: 0.2})
    _windows(chooser, engine, FIRST_BUCKET_WINDOWS + 1)  # one probe: the query is chosen
    engine.runs.clear()
    engine.times[Plan.BUCKETS] = 0.05  # the buckets got cheaper (warmed by the probe)
    _windows(chooser, engine, 20)
    assert engine.runs == [(Plan.QUERY, False)] * 20  # within the period: no probe
    engine.clock.advance(60.0)
    assert _windows(chooser, engine, 2) == ["query", "query"]  # ratios 2 and 0.25
    assert engine.runs[20:23] == [(Plan.QUERY, False), (Plan.BUCKETS, True), (Plan.QUERY, False)]
    assert chooser.ratio == pytest.approx(1.125)  # their median: still the query
    engine.clock.advance(60.0)
    assert _windows(chooser, engine, 2) == ["query", "buckets"]  # a third: 0.25
    assert chooser.probes == 3 and chooser.chosen is Plan.BUCKETS


def test_one_slow_probe_does_not_flip_the_choice() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    for _ in range(3):
        _windows(chooser, engine, FIRST_BUCKET_WINDOWS + 1)
        engine.clock.advance(60.0)
    engine.times[Plan.BUCKETS] = 2.0  # a moment the buckets waited for long
    _windows(chooser, engine, 1)
    assert chooser.probes == 4 and chooser.chosen is Plan.BUCKETS


def test_the_other_plans_failure_fails_nothing_and_gives_no_ratio() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    engine.failing.add(Plan.QUERY)
    assert _windows(chooser, engine, FIRST_BUCKET_WINDOWS + 2) == ["buckets"] * (
        FIRST_BUCKET_WINDOWS + 2
    )
    assert (chooser.probes, chooser.probes_failed, chooser.ratio) == (1, 1, None)


def test_the_chosen_plans_failure_is_the_callers() -> None:
    chooser, engine = _chooser({Plan.BUCKETS: 0.05, Plan.QUERY: 0.2})
    _windows(chooser, engine, FIRST_BUCKET_WINDOWS)
    engine.failing.add(Plan.BUCKETS)
    with pytest.raises(TimeoutError):
        chooser.answer(engine)
    assert engine.runs[-1] == (Plan.BUCKETS, False)  # the probe stopped with it
    assert chooser.ratio is None


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


def test_buckets_dearer_than_the_query_send_the_windows_to_the_query(slow_mongo: Any) -> None:
    backend, proxy = slow_mongo
    lookup = _errors(backend, 0, "measured")  # keeps nothing: each window fills and queries
    expected = lookup.inner.fetch(UNEVEN, Deadline.after_ms(30_000))
    proxy.set_delay_ms(COMMAND_DELAY_MS)
    answers = [_fetch(lookup, UNEVEN) for _ in range(FIRST_BUCKET_WINDOWS + 4)]
    assert lookup.chooser is not None and lookup.chooser.chosen is Plan.QUERY
    assert lookup.store.stats.query_windows == 4  # the one tried, and the three after it
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
    answers = [_fetch(lookup, DAY) for _ in range(FIRST_BUCKET_WINDOWS + 4)]
    assert chooser is not None and chooser.chosen is Plan.BUCKETS
    assert stats.query_windows == 1 and stats.misses == misses  # only the one try queried
    assert all(close_panels(answer, expected) for answer in answers)
