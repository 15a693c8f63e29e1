"""The results cache's answers against the panels' own queries, on a real MongoDB-wire server.

A property test draws documents (late ones included), windows (aligned or not, empty,
within one bucket, across many) and a bucket length, and checks that each MongoDB panel
answered from cached buckets and edges equals the same panel's one query over the window.
Under ``make compat`` it runs on FerretDB 2 as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pymongo
import pytest
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import monitoring

from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import MongoBackendSettings
from lookups.cache.cached import CachedLookup
from lookups.cache.merged import MergedRuns
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import CacheStats, MemoryStore
from lookups.cache.wiring import with_cache
from lookups.deadline import Deadline
from lookups.mongo import (
    QUERY_GROUP_CAP,
    ControllersLookup,
    ErrorsLookup,
    QueriesLookup,
    UrlsLookup,
)
from lookups.mongo_parts import (
    PART_GROUP_CAP,
    NoPart,
    add_parts,
    encode_part,
    part_json_bytes,
    parts_of,
    ranges_filter,
)
from lookups.panels import ErrorSummary, TopList, Window
from service.samples import MongoWireServer
from service.testing import FakeClock
from tests.support.ferretdb import selected_engine

DATABASE = "cache_parts_test"
BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00Z, a multiple of every bucket below
BUCKETS_MS = [60_000, 600_000, 3_600_000]
SPAN_MS = 6 * 3_600_000
NOW_MS = BASE_MS + SPAN_MS  # the cache's clock: the data's last instant
LOOKUPS = (ErrorsLookup, UrlsLookup, ControllersLookup, QueriesLookup)


@pytest.fixture(scope="module")
def backend(mongo_server: MongoWireServer) -> Iterator[MongoBackend]:
    backend = MongoBackend("mongo", MongoBackendSettings(uri=mongo_server.uri, database=DATABASE))
    yield backend
    backend.client.drop_database(DATABASE)
    backend.close()


def _documents(seconds: list[int], picks: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Documents on whole seconds (nx-27017 compares them to the second), with few enough
    keys that ties in the top lists are common."""
    errors, requests, queries = [], [], []
    for second, pick in zip(seconds, picks):
        ts = datetime.fromtimestamp((BASE_MS // 1000) + second, tz=UTC)
        app = ("shop", "search")[pick % 2]
        errors.append({"app": app, "ts": ts, "code": 500, "message": f"boom {pick % 7}"})
        duration = (pick % 13) * 2.5 if pick % 5 else pick % 17  # floats and integers
        request = {
            "app": app,
            "ts": ts,
            "url": f"/u{pick % 11}",
            "controller": f"C{pick % 4}",
            "duration_ms": duration,
            "status": 200,
        }
        if pick % 19 == 0:  # no duration: counted, but not in the mean (nx-27017's $sum
            del request["duration_ms"]  # refuses strings, which MongoDB's skips)
        requests.append(request)
        queries.append(
            {
                "app": app,
                "ts": ts,
                "query": f"SELECT * FROM t WHERE id = {pick % 9}",
                "duration_ms": duration,
            }
        )
    return {"errors": errors, "requests": requests, "queries": queries}


def _seed(backend: MongoBackend, documents: dict[str, list[dict[str, Any]]]) -> None:
    db = backend.db
    for name, rows in documents.items():
        db[name].delete_many({})
        if rows:
            db[name].insert_many([dict(row) for row in rows])
        db[name].create_index(
            [("app", pymongo.ASCENDING), ("ts", pymongo.ASCENDING)], name="app_ts"
        )


def _cached(
    backend: MongoBackend, bucket_ms: int, settle_ms: int, store: MemoryStore
) -> dict[str, CachedLookup]:
    lookups = {cls.name: cls(backend) for cls in LOOKUPS}
    # The buckets for every window: these tests are about them, not the plan's choice.
    settings = CacheSettings(enabled=True, bucket_ms=bucket_ms, settle_ms=settle_ms, plan="buckets")
    cached = with_cache(lookups, settings, store)
    for lookup in cached.values():
        assert isinstance(lookup, CachedLookup)
        lookup._clock = FakeClock(wall_start=NOW_MS / 1000)
    return cached  # type: ignore[return-value]


def _warm(lookup: CachedLookup, window: Window) -> None:
    """Fetch ``window`` until a fetch misses no bucket."""
    for _ in range(50):
        misses = lookup.store.stats.misses
        lookup.fetch(window, Deadline.after_ms(10_000))
        if lookup.store.stats.misses == misses:
            return
    raise AssertionError("the cache never warmed")


def _equal(cached: Any, direct: Any) -> bool:
    _same(cached, direct)
    return True


def _same(cached: Any, direct: Any) -> None:
    """Equal panels: the same totals and entries in the same order, means within 1e-9."""
    assert type(cached) is type(direct)
    if isinstance(direct, ErrorSummary):
        assert cached == direct
        return
    assert isinstance(direct, TopList)
    assert [(e.key, e.count) for e in cached.entries] == [(e.key, e.count) for e in direct.entries]
    for mine, theirs in zip(cached.entries, direct.entries):
        assert mine.mean_ms == pytest.approx(theirs.mean_ms, rel=1e-9, abs=1e-9)
        assert mine.total_ms == pytest.approx(theirs.total_ms, rel=1e-9, abs=1e-9)


_window = st.tuples(st.integers(-600, SPAN_MS // 1000 + 600), st.integers(0, SPAN_MS // 1000))


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seconds=st.lists(st.integers(0, SPAN_MS // 1000 - 1), max_size=120),
    late=st.lists(st.integers(SPAN_MS // 1000 - 300, SPAN_MS // 1000 - 1), max_size=10),
    picks=st.lists(st.integers(0, 1000), min_size=130, max_size=130),
    windows=st.lists(_window, min_size=1, max_size=4),
    aligned=st.booleans(),
    bucket_ms=st.sampled_from(BUCKETS_MS),
    app=st.sampled_from(["shop", "search"]),
)
def test_panels_from_buckets_equal_the_direct_query(
    backend: MongoBackend,
    seconds: list[int],
    late: list[int],
    picks: list[int],
    windows: list[tuple[int, int]],
    aligned: bool,
    bucket_ms: int,
    app: str,
) -> None:
    _seed(backend, _documents(seconds, picks))
    store = MemoryStore(1 << 24)
    cached = _cached(backend, bucket_ms, settle_ms=300_000, store=store)
    deadline = Deadline.after_ms(30_000)
    for start_s, length_s in windows:
        start_ms = BASE_MS + start_s * 1000
        if aligned:
            start_ms -= start_ms % bucket_ms
        window = Window(app, start_ms, start_ms + length_s * 1000)
        for lookup in cached.values():
            direct = lookup.inner.fetch(window, deadline)
            for _ in range(3):  # cold, then warmer: buckets read, then their kept sum
                _same(lookup.fetch(window, deadline), direct)
    # Documents arriving late, within settle_ms: newer buckets are never cached, so they count.
    if late:
        backend.db.requests.insert_many(_documents(late, picks)["requests"])
        window = Window(app, BASE_MS, NOW_MS)
        lookup = cached["urls"]
        _same(lookup.fetch(window, deadline), lookup.inner.fetch(window, deadline))


def test_a_window_of_whole_cached_buckets_queries_nothing_more(backend: MongoBackend) -> None:
    _seed(backend, _documents(list(range(0, SPAN_MS // 1000, 97)), list(range(400)) * 3))
    store = MemoryStore(1 << 24)
    lookup = _cached(backend, 3_600_000, 0, store)["urls"]
    window = Window("shop", BASE_MS, BASE_MS + 3 * 3_600_000)
    first = lookup.fetch(window, Deadline.after_ms(10_000))
    if lookup.groups_by_bucket:  # one query filled all three
        assert (store.stats.misses, store.stats.fills, store.stats.hits) == (3, 3, 0)
        hits, misses = 3, 3
    else:  # the newest two, and then the third
        assert (store.stats.misses, store.stats.fills, store.stats.hits) == (3, 2, 0)
        assert _equal(lookup.fetch(window, Deadline.after_ms(10_000)), first)
        assert (store.stats.misses, store.stats.fills, store.stats.hits) == (4, 3, 2)
        hits, misses = 5, 4
    backend.db.requests.delete_many({})  # what is cached no longer needs the database
    assert _equal(lookup.fetch(window, Deadline.after_ms(10_000)), first)
    assert (store.stats.misses, store.stats.fills, store.stats.hits) == (misses, 3, hits)
    assert lookup.inner.fetch(window, Deadline.after_ms(10_000)) == TopList(())


def test_a_bucket_with_too_many_groups_is_answered_by_the_direct_query(
    backend: MongoBackend,
) -> None:
    second = [i % 3000 for i in range(PART_GROUP_CAP + 1)]
    documents = _documents(second, [0] * len(second))
    for index, row in enumerate(documents["queries"]):
        row["query"] = f"SELECT {index}"  # every statement its own group
    _seed(backend, documents)
    store = MemoryStore(1 << 24)
    lookup = _cached(backend, 3_600_000, 0, store)["queries"]
    window = Window("shop", BASE_MS, BASE_MS + 3_600_000)
    assert lookup.fetch(window, Deadline.after_ms(30_000)) == lookup.inner.fetch(
        window, Deadline.after_ms(30_000)
    )
    assert store.stats.direct == 1 and len(store) == 0


def test_the_memory_store_stays_within_its_bytes() -> None:
    stats = CacheStats()
    store = MemoryStore(1000, stats)
    for index in range(100):
        store.put_many({f"key{index}": b"x" * 90})
        assert stats.bytes <= 1000
    assert stats.bytes == sum(len(f"key{i}") + 90 for i in range(90, 100)) and stats.evictions == 90
    assert store.get_many(["key99", "key0"]) == {"key99": b"x" * 90}
    store.put_many({"huge": b"x" * 2000})  # larger than the bound: never kept
    assert "huge" not in store.get_many(["huge"]) and stats.bytes <= 1000


def test_the_merged_runs_stay_within_their_bytes() -> None:
    runs, parts = MergedRuns(200), parts_of(UrlsLookup(None))  # type: ignore[arg-type]
    assert parts is not None
    for index in range(20):
        runs.put(("urls", "shop", index, index + 5), {f"/u{index}": [index, 1.5, 1]}, parts)
        assert runs.bytes <= 200
    assert runs.get(("urls", "shop", 0, 5)) is None  # the oldest went first
    kept = runs.get(("urls", "shop", 19, 24))
    assert kept is not None and kept.total == {"/u19": [19, 1.5, 1]} and kept.ranked == ["/u19"]
    runs.put(("urls", "shop", 0, 1), {f"/u{i}": [1, 2.0, 1] for i in range(50)}, parts)
    assert runs.get(("urls", "shop", 0, 1)) is None and runs.bytes <= 200  # never kept


def test_ranking_a_run_and_its_edges_from_candidates_equals_ranking_everything() -> None:
    parts = parts_of(QueriesLookup(None))  # type: ignore[arg-type]
    assert parts is not None
    rng = __import__("random").Random(3)
    for _ in range(200):
        run: dict[str | None, list[float]] = {
            f"q{i}": [1, float(rng.randrange(50))] for i in range(rng.randrange(0, 1500))
        }
        edge: dict[str | None, list[float]] = {
            f"q{rng.randrange(2000)}": [1, float(rng.randrange(-1, 200))] for _ in range(30)
        }
        merged = MergedRuns(1 << 30).put(("queries", "shop", 0, 1), run, parts)
        total = add_parts([run, edge])
        ranked = merged.ranked_with(total, edge)
        top = merged.top_with(edge)
        if ranked is None:  # an edge subtracted somewhere: everything is ranked
            assert any(sums[1] < 0 for sums in edge.values()) and top is None
        else:
            assert ranked == parts.ranked_keys(total)
            # The groups that can rank alone give the panel the whole sum gives.
            assert top is not None and len(top) <= len(run) + len(edge)
            assert parts.finish(top, parts.ranked_keys(top)) == parts.finish(total)


@pytest.mark.parametrize("lookup", [ErrorsLookup, QueriesLookup])
def test_ranked_keys_are_the_querys_order_whether_a_few_or_many(lookup: Any) -> None:
    parts = parts_of(lookup(None))
    assert parts is not None
    index, limit = parts.rank_by, parts.limit
    rng = __import__("random").Random(5)
    for size in (0, 1, limit // 2, limit * 4, limit * 4 + 1, limit * 9):
        total: dict[str | None, list[Any]] = {
            f"k{rng.randrange(size * 2 + 1)}": [rng.randrange(4)] * 2 for _ in range(size)
        }
        total.update({None: [rng.randrange(4)] * 2, "": [rng.randrange(4)] * 2})
        # The query's order: the ranked sum descending, then null first, then by key.
        expected = sorted(total, key=lambda k: (-total[k][index], k is not None, k or ""))
        assert parts.ranked_keys(total) == expected[:limit]


def test_what_a_kept_sum_is_counted_at_is_about_its_json_length() -> None:
    parts = parts_of(QueriesLookup(None))  # type: ignore[arg-type]
    assert parts is not None
    rng = __import__("random").Random(7)
    for size in (1, 10, 1000):
        part = {
            "SELECT " + "x" * rng.randrange(200) + str(i): [
                rng.randrange(10**6),
                rng.random() * 1e4,
            ]
            for i in range(size)
        }
        counted, encoded = part_json_bytes(part, len(parts.fields)), len(encode_part(part))
        assert encoded / 2 <= counted <= encoded * 2, (size, counted, encoded)


def test_fifty_callers_fill_each_bucket_once_on_either_engine(backend: MongoBackend) -> None:
    import gevent

    _seed(backend, _documents(list(range(0, SPAN_MS // 1000, 37)), list(range(600)) * 2))
    store = MemoryStore(1 << 24)
    lookup = _cached(backend, 3_600_000, 0, store)["urls"]
    window = Window("shop", BASE_MS, NOW_MS)  # six whole hours
    direct = lookup.inner.fetch(window, Deadline.after_ms(10_000))
    calls = gevent.joinall(
        [gevent.spawn(lookup.fetch, window, Deadline.after_ms(30_000)) for _ in range(50)],
        raise_error=True,
    )
    for call in calls:
        _same(call.value, direct)
    # Where the engine groups by bucket (FerretDB 2) one query fills all six; elsewhere the
    # newest two each round. Either way every bucket is filled once.
    assert lookup.groups_by_bucket is (selected_engine() == "ferretdb")
    assert store.stats.fills == (6 if lookup.groups_by_bucket else 2)
    while store.stats.fills < 6:
        lookup.fetch(window, Deadline.after_ms(10_000))
    _same(lookup.fetch(window, Deadline.after_ms(10_000)), direct)
    assert store.stats.fills == 6 and len(store) == 6


def test_a_window_sliding_across_boundaries_equals_the_direct_query(backend: MongoBackend) -> None:
    """A kept sum moves with the window, a bucket added or dropped at a time."""
    _seed(backend, _documents(list(range(0, SPAN_MS // 1000, 29)), list(range(800)) * 2))
    store = MemoryStore(1 << 24)
    cached = _cached(backend, 600_000, 120_000, store)  # ten-minute buckets: many boundaries
    length_ms = 3 * 3_600_000 + 7_000
    for step in range(0, 100 * 60_000, 7 * 60_000 + 13_000):  # across ten boundaries
        end_ms = BASE_MS + 4 * 3_600_000 + step
        window = Window("shop", end_ms - length_ms, end_ms)
        for lookup in cached.values():
            lookup._clock = FakeClock(wall_start=end_ms / 1000)
            if step == 0:
                _warm(lookup, window)  # every later step moves a kept sum
            _same(
                lookup.fetch(window, Deadline.after_ms(10_000)),
                lookup.inner.fetch(window, Deadline.after_ms(10_000)),
            )


def test_a_window_moving_on_by_one_bucket_leaves_the_run_it_left(backend: MongoBackend) -> None:
    """A sliding window does not come back to its old run: the moved sum takes its room."""
    _seed(backend, _documents(list(range(0, SPAN_MS // 1000, 29)), list(range(800)) * 2))
    lookup = _cached(backend, 600_000, 120_000, MemoryStore(1 << 24))["queries"]
    length_ms = 3 * 3_600_000 + 7_000
    kept = []
    # The second window's start crosses a boundary, its last settled bucket stays.
    for end_ms in (BASE_MS + 4 * 3_600_000 + 300_000, BASE_MS + 4 * 3_600_000 + 660_000):
        window = Window("shop", end_ms - length_ms, end_ms)
        lookup._clock = FakeClock(wall_start=end_ms / 1000)
        _warm(lookup, window)
        _same(
            lookup.fetch(window, Deadline.after_ms(10_000)),
            lookup.inner.fetch(window, Deadline.after_ms(10_000)),
        )
        kept.append(len(lookup._merged))
    assert kept == [1, 1]


def test_a_window_sliding_onto_a_bucket_with_too_many_groups_is_answered_directly(
    backend: MongoBackend,
) -> None:
    seconds = [s for s in range(0, 7200, 50)] + [7200 + s % 3600 for s in range(PART_GROUP_CAP + 1)]
    documents = _documents(seconds, [0] * len(seconds))  # the third hour: crowded
    for index, row in enumerate(documents["queries"]):
        row["query"] = f"SELECT {index}"
    _seed(backend, documents)
    store = MemoryStore(1 << 24)
    lookup = _cached(backend, 3_600_000, 0, store)["queries"]
    for hours in (2, 3):  # the kept sum of two hours moves on to the crowded third
        window = Window("shop", BASE_MS, BASE_MS + hours * 3_600_000)
        lookup._clock = FakeClock(wall_start=window.end_ms / 1000)
        if hours == 2:
            _warm(lookup, window)
        _same(
            lookup.fetch(window, Deadline.after_ms(30_000)),
            lookup.inner.fetch(window, Deadline.after_ms(30_000)),
        )
    assert store.stats.direct == 1


def test_clearing_the_store_leaves_the_merged_runs_counted() -> None:
    stats = CacheStats()
    store, runs = MemoryStore(1000, stats), MergedRuns(200, stats)
    store.put_many({"key": b"x" * 90})
    runs.put(("urls", "shop", 0, 1), {"/u": [1, 1.5, 1]}, parts_of(UrlsLookup(None)))  # type: ignore
    store.clear()
    assert len(store) == 0 and stats.bytes == runs.bytes > 0 and stats.evictions == 0


def _odd_documents() -> dict[str, list[dict[str, Any]]]:
    """Documents whose keys are missing or null and whose durations are integers, 64-bit
    integers, floats or missing: what grouping here must count and sum as the engine does."""
    documents = _documents(list(range(0, 600, 7)), list(range(86)))
    for index, row in enumerate(documents["requests"] + documents["queries"]):
        if index % 7 == 0:
            row.pop("duration_ms", None)
        elif index % 7 == 1:
            row["duration_ms"] = Int64(3_000_000_000 + index)
        for field in ("url", "controller", "query"):
            if field in row and index % 11 == 0:
                del row[field]
            elif field in row and index % 11 == 1:
                row[field] = None
    for index, row in enumerate(documents["errors"]):
        if index % 9 == 0:
            del row["message"]
    return documents


def test_rows_grouped_here_equal_the_engines_groups(backend: MongoBackend) -> None:
    _seed(backend, _odd_documents())
    match = {
        "$match": ranges_filter(
            "shop", [(BASE_MS, BASE_MS + 200_000), (BASE_MS + 300_000, BASE_MS + 600_000)]
        )
    }
    for cls in LOOKUPS:
        parts = parts_of(cls(backend))
        assert parts is not None
        collection = backend.db[cls.collection]
        grouped = parts.part(list(collection.aggregate([match, *parts.stages()])))
        here = parts.part_of_rows(collection.aggregate([match, *parts.row_stages()]))
        assert here.keys() == grouped.keys() and None in here and len(here) > 2, cls.name
        for key, sums in grouped.items():
            assert [type(v) for v in here[key]] == [type(v) for v in sums], (cls.name, key)
            assert here[key] == pytest.approx(sums, rel=1e-12), (cls.name, key)


def test_rows_skip_what_sum_skips_and_refuse_what_a_part_refuses() -> None:
    urls = parts_of(UrlsLookup(None))  # type: ignore[arg-type]
    assert urls is not None
    rows = [
        {"k": "/a", "v": 2},
        {"k": "/a", "v": 1.5},
        {"k": "/a", "v": True},
        {"k": "/a", "v": "7"},
        {"k": "/a", "v": [1]},
        {"k": "/a"},
        {"v": Int64(5)},
        {"k": None, "v": None},
    ]
    assert urls.part_of_rows(rows) == {"/a": [6, 3.5, 2], None: [2, 5, 1]}
    for refused in (
        [{"k": 7}],
        [{"k": ["/a"]}],
        [{"k": "/a", "v": Decimal128("1.5")}],
        [{"k": f"/{n}"} for n in range(PART_GROUP_CAP + 1)],
    ):
        with pytest.raises(NoPart):
            urls.part_of_rows(refused)


def test_edges_with_more_rows_than_a_batch_are_grouped_by_the_engine(
    mongo_server: MongoWireServer,
) -> None:
    commands: list[str] = []

    class Listener(monitoring.CommandListener):
        def started(self, event: monitoring.CommandStartedEvent) -> None:
            commands.append(event.command_name)

        def succeeded(self, event: Any) -> None:
            pass

        def failed(self, event: Any) -> None:
            pass

    backend = MongoBackend(
        "mongo",
        MongoBackendSettings(uri=mongo_server.uri, database=DATABASE),
        event_listeners=[Listener()],
    )
    try:
        crowded = [
            3 * 3600 + s % 600 for s in range(2 * QUERY_GROUP_CAP + 100)
        ]  # half of them shop's
        _seed(backend, _documents(list(range(0, 3 * 3600, 61)) + crowded, list(range(5000))))
        lookup = _cached(backend, 3_600_000, 0, MemoryStore(1 << 24))["errors"]
        window = Window("shop", BASE_MS + 1_000_000, BASE_MS + 3 * 3_600_000 + 700_000)
        lookup._clock = FakeClock(wall_start=window.end_ms / 1000)
        _warm(lookup, Window("shop", window.start_ms, BASE_MS + 3 * 3_600_000))  # no end edge
        for rows_first in (True, False):  # then the app is known to be dense: grouped at once
            commands.clear()
            _same(
                lookup.fetch(window, Deadline.after_ms(30_000)),
                lookup.inner.fetch(window, Deadline.after_ms(30_000)),
            )
            assert commands.count("aggregate") == (3 if rows_first else 2), commands
    finally:
        backend.client.drop_database(DATABASE)
        backend.close()


#: Offsets from a bucket boundary, in milliseconds: on it, a millisecond either side, and the
#: seconds around it (nx-27017 compares dates in an aggregation to the second; FerretDB and
#: MongoDB to the millisecond).
EDGE_OFFSETS_MS = (-1000, -999, -1, 0, 1, 999, 1000)


def test_windows_a_millisecond_off_a_boundary_equal_the_direct_query(
    backend: MongoBackend,
) -> None:
    """Documents on minute boundaries and beside them; windows starting and ending on a
    boundary, a millisecond before or after it, and a second away: each panel from buckets
    and edges equals its own query. Where the engine keeps milliseconds (FerretDB, under
    ``make compat``), the documents also lie a millisecond off, and the errors' total is
    checked against a count of what the window holds."""
    keeps_ms = selected_engine() == "ferretdb"
    offsets = EDGE_OFFSETS_MS if keeps_ms else (-1000, 0, 1000)
    stamps = [k * 60_000 + offset for k in range(1, 6) for offset in offsets]
    # Even picks: every document the window's app's (odd ones are the other app's).
    documents = _documents([0] * len(stamps), [2 * i for i in range(len(stamps))])
    for rows in documents.values():
        for row, stamp in zip(rows, stamps):
            row["ts"] = datetime.fromtimestamp((BASE_MS + stamp) / 1000, tz=UTC)
    _seed(backend, documents)
    store = MemoryStore(1 << 24)
    cached = _cached(backend, 60_000, 0, store)
    for start, end in [(60_000 + a, 4 * 60_000 + b) for a in EDGE_OFFSETS_MS for b in (-1, 0, 1)]:
        window = Window("shop", BASE_MS + start, BASE_MS + end)
        for lookup in cached.values():
            direct = lookup.inner.fetch(window, Deadline.after_ms(30_000))
            for _ in range(2):  # cold, then from the buckets filled
                _same(lookup.fetch(window, Deadline.after_ms(30_000)), direct)
            if keeps_ms and isinstance(direct, ErrorSummary):
                held = [stamp for stamp in stamps if start <= stamp < end]
                assert direct.total == len(held), (start, end)
    assert store.stats.hits > 0 and store.stats.fills > 0
