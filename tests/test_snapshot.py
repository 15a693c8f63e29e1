"""One snapshot of a service's parts: what ``pool_stats()`` and the metrics both read."""

from __future__ import annotations

from lookups.resilience.breaker import CircuitState
from service.operations import service_metrics
from service.operations.snapshot import take
from service.rpc.pool_report import own_report
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.samples import GENEROUS_BUDGETS, StartService

PANELS = 7  # the sample lookups: four on MongoDB, three on the HTTP services


def test_a_snapshot_copies_the_counters_and_the_pool_report_is_read_from_it(
    start_service: StartService,
) -> None:
    # Budgets a busy machine keeps: the test counts what the backends did, not deadlines.
    patient = {key.replace(".", "__"): value for key, value in GENEROUS_BUDGETS.items()}
    # The buckets, whose hits the snapshot shows, not the measured plan's choice.
    service, client = start_service(
        cache__enabled=True, cache__plan="buckets", fanout__coalesce=True, **patient
    )
    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    first = take(service.parts)
    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    second = take(service.parts)
    # Counts copied, not shared: the first snapshot still says what it said.
    assert (first.tasks.started, second.tasks.started) == (PANELS, 2 * PANELS)
    assert first.cache is not None and second.cache is not None
    assert second.cache.hits > first.cache.hits
    names = [pool.name for pool in first.pools]
    assert "fanout.tasks" in names and names[-3:] == ["mongo", "alerts", "metrics"], names
    assert {b.name for b in first.backends} == {"mongo", "alerts", "metrics"}
    assert all(b.circuit is CircuitState.CLOSED and b.attempts > 0 for b in first.backends)
    # A call may still fail on a loaded machine (a stressed run saw one): counted, not zero.
    assert all(0 <= b.failures <= b.calls and b.calls > 0 for b in first.backends)
    report = own_report(second)
    assert report["tasks_started"] == 2 * PANELS
    assert report["cache_hits"] == second.cache.hits
    assert [pool["name"] for pool in report["pools"]] == [pool.name for pool in second.pools]
    # pool_stats() over the wire takes its own snapshot of the same parts.
    answered = client.pool_stats()
    assert answered.tasks_started == take(service.parts).tasks.started == 2 * PANELS
    assert answered.cache_hits == second.cache.hits


def test_one_collection_reads_one_snapshot_and_the_next_takes_a_new_one(
    start_service: StartService,
) -> None:
    service, client = start_service()
    collection = service_metrics._Collection()
    collection.services.add(service.parts)
    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    pools, tasks = collection.read("fanout.pool.size"), collection.read("fanout.tasks.started")
    assert pools is tasks and [s.tasks.started for s in pools] == [PANELS]
    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    # An instrument asking again begins the next collection, in whichever order they ask.
    again = collection.read("fanout.tasks.started")
    assert again is not pools and [s.tasks.started for s in again] == [2 * PANELS]
    assert collection.read("fanout.pool.size") is again
