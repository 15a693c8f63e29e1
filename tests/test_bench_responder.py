"""The benchmark's light backends answer as the real ones do, after their delay.

The MongoDB-wire responder replays answers recorded from nx-27017: the real lookups
must get the same panels from it as from nx-27017 (which proves the recording is
current and that pymongo 4.20's handshake works against it). The lean HTTP backend
must answer the HTTP lookups as the sample WSGI services do. A whole benchmark stack
is started once, to prove its processes come up, serve, and go away.
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import pymongo
import pytest
from pymongo.errors import OperationFailure

from bench.harness.calls import sample_call
from bench.harness.stack import StackSpec, start_stack
from bench.servers.http_backend import BenchHttpBackends
from bench.servers.mongo_answers import RecordedAnswers
from bench.servers.mongo_responder import MongoResponder
from lookups.backends.collection import Backends
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BadBackendResponse
from lookups.panels import Window
from lookups.registry import default_registry
from service.client import AppStatsClient
from service.idl import appstats
from service.settings.config import Settings, load_settings

WINDOW = Window(*sample_call())
DELAY_MS = 150


@pytest.fixture(scope="module")
def answers() -> RecordedAnswers:
    return RecordedAnswers.load()


def _fetch_all(settings: Settings, source: str, budget_s: float = 5.0) -> dict[str, Any]:
    """Every ``source`` lookup of the default registry, fetched for the sample call."""
    with Backends(settings.backends) as backends:
        return {
            name: lookup.fetch(WINDOW, Deadline.after_s(budget_s))
            for name, lookup in default_registry().build(backends).items()
            if lookup.source == source
        }


def _mongo_settings(responder: MongoResponder) -> Settings:
    return load_settings(
        env={},
        overrides={
            "mongo.uri": responder.uri,
            "mongo.database": "apm",
            "mongo.server_selection_timeout_ms": 5000,
        },
    )


def test_the_responder_gives_the_lookups_what_nx_27017_gives(backend_settings, answers):
    expected = _fetch_all(backend_settings, "mongo")
    with MongoResponder(answers) as responder:
        actual = _fetch_all(_mongo_settings(responder), "mongo")
        assert responder.aggregations == len(expected)
    assert sorted(answers.lookups()) == sorted(expected)
    assert expected["errors"].total > 0 and expected["queries"].entries
    assert actual == expected


def test_the_responder_waits_its_delay_before_each_aggregation(answers):
    with MongoResponder(answers, delay_ms=DELAY_MS) as responder:
        with Backends(_mongo_settings(responder).backends) as backends:
            lookup = default_registry().build(backends)["urls"]
            for _ in range(2):
                started = time.monotonic()
                lookup.fetch(WINDOW, Deadline.after_s(5.0))
                elapsed_s = time.monotonic() - started
                # At least the delay (a little slack for the event loop's cached clock).
                assert 0.95 * DELAY_MS / 1000 <= elapsed_s < 5.0


def test_a_budget_shorter_than_the_delay_times_out_as_with_mongodb(answers):
    with MongoResponder(answers, delay_ms=3000) as responder:
        with Backends(_mongo_settings(responder).backends) as backends:
            lookup = default_registry().build(backends)["errors"]
            started = time.monotonic()
            with pytest.raises(BackendTimeout):
                lookup.fetch(WINDOW, Deadline.after_s(0.3))
            assert time.monotonic() - started < 2.5


def test_an_unrecorded_pipeline_is_refused_not_answered_wrongly(answers):
    with MongoResponder(answers) as responder:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
            responder.uri, serverSelectionTimeoutMS=5000
        )
        try:
            assert client.admin.command("ping")["ok"] == 1.0
            with pytest.raises(OperationFailure) as failure:
                list(client.apm.errors.aggregate([{"$match": {"app": "shop"}}, {"$count": "n"}]))
            assert failure.value.code == 2
        finally:
            client.close()


def test_the_lean_http_backend_answers_as_the_sample_services(backend_settings):
    expected = _fetch_all(backend_settings, "http")
    with BenchHttpBackends() as lean:
        settings = load_settings(
            env={},
            overrides={"http.alerts_url": lean.alerts.url, "http.metrics_url": lean.metrics.url},
        )
        actual = _fetch_all(settings, "http")
        again = _fetch_all(settings, "http")  # from its cache this time
    assert expected["alerts"].alerts and expected["latency"].points
    assert actual == expected == again


def test_the_lean_http_backend_waits_its_delay():
    with BenchHttpBackends(delay_ms=DELAY_MS) as lean:
        settings = load_settings(
            env={},
            overrides={"http.alerts_url": lean.alerts.url, "http.metrics_url": lean.metrics.url},
        )
        with Backends(settings.backends) as backends:
            lookup = default_registry().build(backends)["alerts"]
            started = time.monotonic()
            lookup.fetch(WINDOW, Deadline.after_s(5.0))
            assert 0.95 * DELAY_MS / 1000 <= time.monotonic() - started < 5.0


def test_the_lean_http_backend_fails_every_nth_request_with_a_body_cut_short():
    with BenchHttpBackends(fail_every=3) as lean:
        settings = load_settings(
            env={},
            overrides={"http.alerts_url": lean.alerts.url, "http.metrics_url": lean.metrics.url},
        )
        with Backends(settings.backends) as backends:
            lookup = default_registry().build(backends)["alerts"]
            failed = []
            for _ in range(6):
                try:
                    lookup.fetch(WINDOW, Deadline.after_s(5.0))
                    failed.append(False)
                except BadBackendResponse:
                    failed.append(True)
    assert failed == [False, False, True, False, False, True]


def test_a_fanout_stack_serves_every_panel_and_leaves_no_process_behind():
    with start_stack(
        StackSpec(server="fanout", delay_ms=5, max_connections=100), timeout_s=60
    ) as stack:
        pids = [p.pid for process in stack.processes.values() for p in process.processes()]
        host, port = stack.address
        before = stack.mongo_aggregations()
        with AppStatsClient(host, port, timeout_ms=5000) as client:
            response = client.get_app_stats(*sample_call(), deadline_ms=5000)
        after = stack.mongo_aggregations()
        cpu = stack.cpu_seconds()
    assert [o.status for o in response.outcomes] == [appstats.TaskStatus.OK] * 7
    assert before is not None and after is not None
    assert after - before == 4  # one aggregation a MongoDB panel, as `make bench` reports per call
    assert set(cpu) == {"server", "mongo", "http", "otlp"} and cpu["server"] > 0
    assert not [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]


def test_each_window_gets_its_mongodb_commands_per_call_answered():
    from bench.harness.runner import _add_mongo_commands

    reps = [{"ok": 10, "degraded": 2}, {"ok": 0, "degraded": 0}, {"ok": 5, "degraded": 0}]
    _add_mongo_commands(reps, [100, 148, 148, 168])
    assert [r["mongo_commands"] for r in reps] == [48, 0, 20]
    assert [r["mongo_commands_per_reply"] for r in reps] == [4.0, None, 4.0]
    unknown = [{"ok": 1, "degraded": 0}]
    _add_mongo_commands(unknown, [None, None])  # nx-27017: not counted
    assert "mongo_commands" not in unknown[0]
