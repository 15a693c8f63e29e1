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


def _windows(chooser: PlanChooser, times: dict[Plan, float], count: int) -> list[Plan]:
    """Answer ``count`` windows, each plan taking its time in ``times``; the plans used."""
    used = []
    for _ in range(count):
        plan = chooser.choose()
        chooser.record(plan, times[plan])
        used.append(plan)
    return used


def test_the_buckets_go_first_then_the_query_is_tried_and_the_cheaper_answers() -> None:
    chooser = PlanChooser(60.0, FakeClock().monotonic)
    used = _windows(chooser, {Plan.BUCKETS: 0.4, Plan.QUERY: 0.2}, FIRST_BUCKET_WINDOWS + 4)
    assert used == [Plan.BUCKETS] * FIRST_BUCKET_WINDOWS + [Plan.QUERY] * 4
    assert chooser.chosen is Plan.QUERY and chooser.mean_s(Plan.BUCKETS) == 0.4


def test_the_first_windows_measure_the_buckets_warm_not_by_the_fill() -> None:
    chooser = PlanChooser(60.0, FakeClock().monotonic)
    for elapsed_s in (3.0, 0.01, 0.01):  # the first window filled every bucket
        chooser.record(chooser.choose(), elapsed_s)
    assert _windows(chooser, {Plan.BUCKETS: 0.01, Plan.QUERY: 0.2}, 4) == [
        Plan.QUERY,
        *[Plan.BUCKETS] * 3,
    ]


def test_the_plan_not_chosen_is_tried_again_once_per_replan_period() -> None:
    clock = FakeClock()
    chooser = PlanChooser(60.0, clock.monotonic)
    times = {Plan.BUCKETS: 0.4, Plan.QUERY: 0.2}
    _windows(chooser, times, FIRST_BUCKET_WINDOWS + 1)
    clock.advance(59.0)
    assert _windows(chooser, times, 5) == [Plan.QUERY] * 5
    clock.advance(1.0)
    times[Plan.BUCKETS] = 0.05  # the buckets got cheaper: one try sees it
    assert _windows(chooser, times, 3) == [Plan.BUCKETS] * 3
    assert chooser.chosen is Plan.BUCKETS


def test_one_window_at_a_time_tries_the_other_plan() -> None:
    chooser = PlanChooser(60.0, FakeClock().monotonic)
    _windows(chooser, {Plan.BUCKETS: 0.1, Plan.QUERY: 0.1}, FIRST_BUCKET_WINDOWS)
    trying = chooser.choose()
    assert trying is Plan.QUERY and chooser.choose() is Plan.BUCKETS  # while it runs
    chooser.record(trying, 0.5)
    assert chooser.choose() is Plan.BUCKETS


def test_a_failed_window_can_make_its_plan_look_dearer_never_cheaper() -> None:
    chooser = PlanChooser(60.0, FakeClock().monotonic)
    _windows(chooser, {Plan.BUCKETS: 0.3, Plan.QUERY: 0.2}, FIRST_BUCKET_WINDOWS + 1)
    chooser.record(Plan.QUERY, 0.001, answered=False)  # refused at once: says nothing
    assert chooser.mean_s(Plan.QUERY) == 0.2
    chooser.record(Plan.QUERY, 2.0, answered=False)  # timed out: at least that dear
    assert chooser.mean_s(Plan.QUERY) == pytest.approx(0.2 + 0.3 * 1.8)
    assert chooser.chosen is Plan.BUCKETS


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
