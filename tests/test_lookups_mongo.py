"""The four MongoDB panels against a seeded MongoDB-wire server, and their failures.

Expected values are computed here from the SampleData records in plain Python.
Window bounds are whole seconds, like the records (see service.samples.seed).
"""

from __future__ import annotations

import socket
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import gevent
import pymongo
import pytest
from gevent.server import StreamServer

from lookups.backends.collection import Backends
from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import MongoBackendSettings, backends_from_aliases
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BackendUnavailable, BadBackendResponse
from lookups.mongo import (
    QUERY_GROUP_CAP,
    ControllersLookup,
    ErrorsLookup,
    QueriesLookup,
    UrlsLookup,
    aggregate_one_batch,
    normalise_query,
)
from lookups.panels import ErrorSummary, TopList, Window
from lookups.settings import HttpSettings, MongoSettings
from service.samples import MongoWireServer, SampleData
from service.samples.faults import TcpFaultProxy
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.samples import SAMPLE_DATABASE
from tests.support.sockets import dead_port
from tracing.context import spawn_in_context

HOUR_MS = 3_600_000
FLOAT_TOLERANCE: dict[str, Any] = {"rel": 1e-9, "abs": 1e-6}


def _windows(data: SampleData) -> dict[str, tuple[int, int]]:
    """Named windows; 'narrow' starts on a record and ends on another (half-open check)."""
    stamps = sorted({r.ts_ms for r in data.requests if r.app == "shop"})
    return {
        "day": (SAMPLE_START_MS, SAMPLE_END_MS),
        "three_hours": (SAMPLE_START_MS + 6 * HOUR_MS, SAMPLE_START_MS + 9 * HOUR_MS),
        "narrow": (stamps[100], stamps[160]),
        "empty": (SAMPLE_END_MS + HOUR_MS, SAMPLE_END_MS + 2 * HOUR_MS),
        "zero_length": (stamps[100], stamps[100]),
    }


WINDOW_NAMES = ["day", "three_hours", "narrow", "empty", "zero_length"]
APPS = ["shop", "search", "billing", "no-such-app"]


def _in_window(records: Iterable[Any], window: Window) -> list[Any]:
    return [
        r for r in records if r.app == window.app and window.start_ms <= r.ts_ms < window.end_ms
    ]


def _window(data: SampleData, app: str, name: str) -> Window:
    start_ms, end_ms = _windows(data)[name]
    return Window(app, start_ms, end_ms)


def _expected_top(
    records: list[Any], key_of: Callable[[Any], str]
) -> list[tuple[str, int, float, float]]:
    durations: dict[str, list[float]] = defaultdict(list)
    for record in records:
        durations[key_of(record)].append(record.duration_ms)
    rows = [
        (key, len(values), sum(values) / len(values), sum(values))
        for key, values in durations.items()
    ]
    return sorted(rows, key=lambda row: (-row[1], row[0]))[:10]


P = TypeVar("P", ErrorSummary, TopList)


def _fetched(lookup: Any, window: Window, kind: type[P]) -> P:
    """What ``lookup`` answers for ``window``, checked to be a ``kind``."""
    value = lookup.fetch(window, Deadline.after_s(5.0))
    assert isinstance(value, kind), value
    return value


def _assert_top_list(actual: TopList, expected: list[tuple[str, int, float, float]]) -> None:
    assert [(e.key, e.count) for e in actual.entries] == [
        (key, count) for key, count, _, _ in expected
    ]
    for entry, (_, _, mean_ms, total_ms) in zip(actual.entries, expected):
        assert entry.mean_ms == pytest.approx(mean_ms, **FLOAT_TOLERANCE)
        assert entry.total_ms == pytest.approx(total_ms, **FLOAT_TOLERANCE)


def test_narrow_window_bounds_fall_on_records(sample_data: SampleData) -> None:
    start_ms, end_ms = _windows(sample_data)["narrow"]
    stamps = {r.ts_ms for r in sample_data.requests if r.app == "shop"}
    assert start_ms in stamps and end_ms in stamps and start_ms < end_ms


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", WINDOW_NAMES)
def test_errors_panel(
    backends: Backends, sample_data: SampleData, app: str, window_name: str
) -> None:
    window = _window(sample_data, app, window_name)
    records = _in_window(sample_data.errors, window)
    counts = Counter(r.message for r in records)
    expected_top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:10]

    summary = _fetched(ErrorsLookup(backends.mongo()), window, ErrorSummary)

    assert summary.total == len(records)
    assert [(m.message, m.count) for m in summary.top] == expected_top


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", WINDOW_NAMES)
def test_urls_panel(
    backends: Backends, sample_data: SampleData, app: str, window_name: str
) -> None:
    window = _window(sample_data, app, window_name)
    expected = _expected_top(_in_window(sample_data.requests, window), lambda r: r.url)
    _assert_top_list(_fetched(UrlsLookup(backends.mongo()), window, TopList), expected)


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", WINDOW_NAMES)
def test_controllers_panel(
    backends: Backends, sample_data: SampleData, app: str, window_name: str
) -> None:
    window = _window(sample_data, app, window_name)
    expected = _expected_top(_in_window(sample_data.requests, window), lambda r: r.controller)
    _assert_top_list(_fetched(ControllersLookup(backends.mongo()), window, TopList), expected)


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", WINDOW_NAMES)
def test_queries_panel(
    backends: Backends, sample_data: SampleData, app: str, window_name: str
) -> None:
    window = _window(sample_data, app, window_name)
    totals: dict[str, list[float]] = defaultdict(list)
    for record in _in_window(sample_data.queries, window):
        totals[record.shape].append(record.duration_ms)
    expected = sorted(
        ((shape, len(d), sum(d) / len(d), sum(d)) for shape, d in totals.items()),
        key=lambda row: (-row[3], row[0]),
    )[:10]
    _assert_top_list(_fetched(QueriesLookup(backends.mongo()), window, TopList), expected)


def test_a_wide_window(backends: Backends, sample_data: SampleData) -> None:
    window = Window("search", 0, 4_102_444_800_000)  # 1970 to 2100
    summary = _fetched(ErrorsLookup(backends.mongo()), window, ErrorSummary)
    assert summary.total == sum(1 for r in sample_data.errors if r.app == "search")


def test_whole_day_panels_are_full(backends: Backends, sample_data: SampleData) -> None:
    """The seeded data is rich enough that every top list is cut at ten."""
    window = _window(sample_data, "shop", "day")
    for lookup in (UrlsLookup(backends.mongo()), QueriesLookup(backends.mongo())):
        assert len(_fetched(lookup, window, TopList).entries) == 10
    assert len(_fetched(ErrorsLookup(backends.mongo()), window, ErrorSummary).top) == 10


@pytest.mark.parametrize(
    ("raw", "shape"),
    [
        ("SELECT * FROM orders WHERE id = 4812", "SELECT * FROM orders WHERE id = ?"),
        (
            "SELECT * FROM users WHERE name = 'O''Brien' AND age > 30.5",
            "SELECT * FROM users WHERE name = ? AND age > ?",
        ),
        ("SELECT * FROM t1 WHERE id IN (1, 2,3)", "SELECT * FROM t1 WHERE id IN (?)"),
        ("select * from t where id in(7)", "select * from t where id in (?)"),
        ("INSERT INTO e (a, b) VALUES ('x', 2)", "INSERT INTO e (a, b) VALUES (?, ?)"),
        (
            "SELECT id FROM audit_2025\n    WHERE user_id = 7",
            "SELECT id FROM audit_2025 WHERE user_id = ?",
        ),
        ("UPDATE t SET v = 'it\\'s' WHERE k = 1e3", "UPDATE t SET v = ? WHERE k = ?"),
    ],
)
def test_normalise_query(raw: str, shape: str) -> None:
    assert normalise_query(raw) == shape


@pytest.fixture
def scratch(mongo_server: MongoWireServer) -> Iterator[MongoBackend]:
    """A backend on a scratch database of the session's server, dropped afterwards."""
    backend = MongoBackend(
        "mongo",
        MongoBackendSettings(
            uri=mongo_server.uri, database="malformed_test", server_selection_timeout_ms=5000
        ),
    )
    try:
        yield backend
    finally:
        backend.client.drop_database("malformed_test")
        backend.close()


def test_malformed_documents_are_a_bad_response(scratch: MongoBackend) -> None:
    malformed_db = scratch.db
    ts = datetime(2026, 1, 1, 1, tzinfo=UTC)
    malformed_db.requests.insert_one(
        {"app": "shop", "ts": ts, "url": 404, "controller": None, "duration_ms": 5.0}
    )
    malformed_db.errors.insert_one({"app": "shop", "ts": ts, "code": 1})  # no message
    window = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    for lookup in (UrlsLookup(scratch), ControllersLookup(scratch), ErrorsLookup(scratch)):
        with pytest.raises(BadBackendResponse) as caught:
            lookup.fetch(window, Deadline.after_s(5.0))
        assert caught.value.retryable is False


def test_a_result_past_one_batch_comes_back_whole(scratch: MongoBackend) -> None:
    malformed_db = scratch.db
    # The lookups' pipelines end in a $limit that one batch holds; a result that needs
    # a second batch still comes back whole (through Collection.aggregate).
    malformed_db.many.insert_many([{"n": n} for n in range(QUERY_GROUP_CAP + 500)])
    reply = malformed_db.command(
        "aggregate", "many", pipeline=[{"$sort": {"n": 1}}], cursor={"batchSize": QUERY_GROUP_CAP}
    )
    assert reply["cursor"]["id"] != 0  # the server did split it
    documents = aggregate_one_batch(malformed_db, "many", [{"$sort": {"n": 1}}])
    assert [d["n"] for d in documents] == list(range(QUERY_GROUP_CAP + 500))
    one_batch = aggregate_one_batch(malformed_db, "many", [{"$sort": {"n": 1}}, {"$limit": 3}])
    assert [d["n"] for d in one_batch] == [0, 1, 2]


def test_unreachable_mongo_is_unavailable_within_budget() -> None:
    uri = f"mongodb://fanout:s3cret@127.0.0.1:{dead_port()}/?authSource=admin"
    settings = MongoSettings(uri=uri, server_selection_timeout_ms=10_000)
    with Backends(backends_from_aliases(settings, HttpSettings())) as backends:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            ErrorsLookup(backends.mongo()).fetch(
                Window("shop", SAMPLE_START_MS, SAMPLE_END_MS), Deadline.after_s(0.5)
            )
        elapsed = time.monotonic() - started
    assert elapsed < 0.5 + 1.5
    assert caught.value.retryable is True
    assert "s3cret" not in str(caught.value) and uri not in str(caught.value)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers; yields its port."""

    def hold(connection: socket.socket, address: Any) -> None:
        connection.recv(65536)
        gevent.sleep(30)

    server = StreamServer(("127.0.0.1", 0), hold)
    server.start()
    try:
        yield server.server_port
    finally:
        server.stop(timeout=1)


def test_silent_mongo_is_a_timeout_within_budget(silent_server: int) -> None:
    """A server that accepts but never answers is slow, not known to be down."""
    settings = MongoSettings(
        uri=f"mongodb://127.0.0.1:{silent_server}",
        connect_timeout_ms=10_000,
        server_selection_timeout_ms=10_000,
    )
    with Backends(backends_from_aliases(settings, HttpSettings())) as backends:
        started = time.monotonic()
        with pytest.raises(BackendTimeout) as caught:
            UrlsLookup(backends.mongo()).fetch(
                Window("shop", SAMPLE_START_MS, SAMPLE_END_MS), Deadline.after_s(0.5)
            )
        elapsed = time.monotonic() - started
    assert elapsed < 0.5 + 1.5
    assert caught.value.retryable is True


def test_mongo_killed_mid_session_is_unavailable() -> None:
    window = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    with MongoWireServer() as server:
        with Backends(
            backends_from_aliases(MongoSettings(uri=server.uri), HttpSettings())
        ) as backends:
            assert UrlsLookup(backends.mongo()).fetch(window, Deadline.after_s(5.0)) == TopList(())
            server.kill()
            for _ in range(2):  # first on the pooled connection, then on selection
                with pytest.raises(BackendUnavailable):
                    UrlsLookup(backends.mongo()).fetch(window, Deadline.after_s(0.5))
            assert backends.connections_in_use()["mongo"] == 0


class _AggregateBudgets(pymongo.monitoring.CommandListener):
    """When each ``aggregate`` went out, and the ``maxTimeMS`` it carried."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, int]] = []

    def started(self, event: Any) -> None:
        if event.command_name == "aggregate":
            self.sent.append((time.monotonic(), int(event.command.get("maxTimeMS", 0))))

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass


def test_after_a_restart_the_query_keeps_the_budget_left_after_selection(mongo_server: Any) -> None:
    """A restart marks the server unusable; once selected again, the query gets all that
    is left of the task's budget, not the budget rounded down to whole selection steps."""
    window = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    budgets = _AggregateBudgets()
    with TcpFaultProxy(("127.0.0.1", mongo_server.port)) as proxy:
        backend = MongoBackend(
            "mongo",
            MongoBackendSettings(
                uri=f"mongodb://127.0.0.1:{proxy.address[1]}/?directConnection=true",
                database=SAMPLE_DATABASE,
            ),
            event_listeners=[budgets],
        )
        try:
            lookup = ErrorsLookup(backend)
            lookup.fetch(window, Deadline.after_s(5.0))
            proxy.reset_all()
            began = time.monotonic()
            lookup.fetch(window, Deadline.after_s(1.9))
        finally:
            backend.close()
    sent_at, max_time_ms = budgets.sent[-1]
    assert len(budgets.sent) >= 3  # the first call, the reset one, the retry
    # The retry's query may run until the task's budget ends (less a round trip), past
    # the 1.5 s that whole steps would leave it.
    assert sent_at + max_time_ms / 1000 - began > 1.7


def test_spent_budget_is_a_timeout(backends: Backends) -> None:
    window = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    for budget in (0.0, -1.0, 1e-6):
        with pytest.raises(BackendTimeout) as caught:
            QueriesLookup(backends.mongo()).fetch(window, Deadline.after_s(budget))
        assert caught.value.retryable is True and isinstance(caught.value, TimeoutError)


def test_connections_are_returned_after_a_burst(
    backends: Backends, sample_data: SampleData
) -> None:
    window = _window(sample_data, "shop", "day")
    lookups = [
        ErrorsLookup(backends.mongo()),
        UrlsLookup(backends.mongo()),
        ControllersLookup(backends.mongo()),
        QueriesLookup(backends.mongo()),
    ]
    most_in_use = 0
    timed_out: set[int] = set()

    def run(index: int) -> None:
        budget = 1e-6 if index % 3 == 0 else 5.0  # every third one times out
        try:
            lookups[index % len(lookups)].fetch(window, Deadline.after_s(budget))
        except BackendTimeout:
            timed_out.add(index)

    workers = [spawn_in_context(run, index) for index in range(24)]
    for _ in range(10_000):
        most_in_use = max(most_in_use, backends.connections_in_use()["mongo"])
        if all(worker.dead for worker in workers):
            break
        gevent.sleep(0.001)
    gevent.joinall(workers, timeout=30, raise_error=True)
    assert timed_out == set(range(0, 24, 3))  # those and only those, each as a timeout
    assert most_in_use >= 1, "the counter never saw a connection checked out"
    assert backends.connections_in_use()["mongo"] == 0


def test_normalise_query_long_statements_bypass_the_cache_with_the_same_result() -> None:
    padding = "col_" + "x" * 3000
    long_statement = f"SELECT {padding} FROM orders WHERE id = 4812 AND tag IN ('a', 'b')"
    assert (
        normalise_query(long_statement)
        == f"SELECT {padding} FROM orders WHERE id = ? AND tag IN (?)"
    )
    short = "SELECT * FROM t WHERE id = 7"
    assert normalise_query(short) == normalise_query(short) == "SELECT * FROM t WHERE id = ?"


# Run in a process gevent never patched: the lookups are also driven from OS threads
# (the threaded benchmark baseline), where they take a different path.
_UNPATCHED_THREADS_SCRIPT = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from lookups.backends.collection import Backends
from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import MongoBackendSettings, backends_from_aliases
from lookups.panels import Window
from lookups.deadline import Deadline
from lookups.registry import default_registry
from service.settings.config import load_settings
settings = load_settings(env={}, overrides=json.loads(sys.argv[1]))
window = Window(*json.loads(sys.argv[2]))
backends = Backends(settings.backends)
lookups = default_registry().build(backends)
with ThreadPoolExecutor(4) as pool:
    futures = {name: pool.submit(lookups[name].fetch, window, Deadline.after_s(2.0))
               for name in ("errors", "urls", "controllers", "queries")}
    print(json.dumps({name: repr(future.result()) for name, future in futures.items()}))
backends.close()
"""


def test_mongo_lookups_from_plain_threads_give_the_same_panels(
    backends: Backends, mongo_server, http_services
) -> None:
    import json
    import subprocess
    import sys

    from lookups.registry import default_registry
    from tests.support.samples import backend_overrides

    window = ("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _UNPATCHED_THREADS_SCRIPT,
            json.dumps(backend_overrides(mongo_server, http_services)),
            json.dumps(window),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from_threads = json.loads(done.stdout.strip().splitlines()[-1])
    lookups = default_registry().build(backends)
    for name, value in from_threads.items():
        assert value == repr(lookups[name].fetch(Window(*window), Deadline.after_s(2.0))), name


def test_a_pipeline_the_server_refuses_fails_once_as_a_bad_response(backends: Backends) -> None:
    # A valid command the server refuses (an unknown stage): not a connection problem, so
    # never retried, and typed as what it is.
    mongo = backends.mongo()
    attempts_before = mongo.guard.attempts
    with pytest.raises(BadBackendResponse) as refused:
        mongo.run(
            "errors",
            lambda db: list(db["errors"].aggregate([{"$noSuchStage": {}}])),
            Deadline.after_s(5.0),
        )
    assert not refused.value.retry_safe and "refused the aggregation" in str(refused.value)
    assert mongo.guard.attempts - attempts_before == 1
