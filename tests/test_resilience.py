"""Backends that misbehave: retries within budget, circuit breakers, hedging, client churn."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import gevent
import pytest

from lookups.backends.http import HttpBackend
from lookups.backends.settings import HttpBackendSettings
from lookups.deadline import Deadline
from lookups.errors import BackendUnavailable, CircuitOpen
from lookups.http import AlertsLookup
from lookups.panels import Window
from lookups.resilience import BreakerPolicy, CircuitBreaker, CircuitState, RetryPolicy
from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData
from service.samples.faults import FaultyHttpService, TcpFaultProxy
from service.testing import FakeClock, SkippingClock
from tests.support.samples import SAMPLE_DATABASE
from tests.support.sockets import dead_port, wait_for

WINDOW = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
PANELS = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]


@contextmanager
def alerts_lookup(url: str, hedge: bool = False, **settings: Any) -> Iterator[AlertsLookup]:
    """The alerts panel on a backend of its own at ``url``, closed afterwards."""
    backend = HttpBackend(
        "alerts", HttpBackendSettings(url=url, **settings), {"alerts": RetryPolicy(hedge=hedge)}
    )
    try:
        yield AlertsLookup(backend)
    finally:
        backend.close()


def fetch_many(
    lookup: AlertsLookup, callers: int, each: int, budget_s: float, pause_s: float = 0.0
) -> list[Any]:
    """``callers`` greenlets each fetching ``each`` times (``pause_s`` apart); the values or
    the exceptions."""

    def caller() -> list[Any]:
        results: list[Any] = []
        for _ in range(each):
            gevent.sleep(pause_s)
            try:
                results.append(lookup.fetch(WINDOW, Deadline.after_s(budget_s)))
            except Exception as failure:  # collected, asserted on by the test
                results.append(failure)
        return results

    greenlets = [gevent.spawn(caller) for _ in range(callers)]
    gevent.joinall(greenlets, timeout=120)
    return [result for g in greenlets for result in g.get()]


# A single-threaded HTTP/1.0 server with Python's default listen backlog (5), in its own
# process as a real service would be. It prints its port, serves until stdin closes.
_BACKLOG5_SERVER = r"""
import http.server, json, sys, threading
class Alerts(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def do_GET(self):
        body = json.dumps({"alerts": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Alerts)
assert server.request_queue_size == 5
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
sys.stdin.read()
"""


@pytest.fixture
def backlog5() -> Iterator[str]:
    """The URL of a real single-threaded HTTP/1.0 server with a listen backlog of 5."""
    process = subprocess.Popen(
        [sys.executable, "-c", _BACKLOG5_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with gevent.Timeout(20, AssertionError("the backlog-5 server did not start")):
            assert process.stdout is not None
            port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=10)


@pytest.mark.solo
def test_a_backlog_of_five_under_twenty_callers_loses_no_panel(backlog5: str) -> None:
    with alerts_lookup(backlog5) as lookup:
        results = fetch_many(lookup, callers=20, each=14, budget_s=8.0)
    failures = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 280 and failures == [], failures[:3]
    guard = lookup.backend.guard
    assert guard.budget.retries <= 0.2 * 280 + guard.budget.min_per_s * 60 + guard.budget.max_tokens


@pytest.mark.solo
def test_a_service_flapping_503s_costs_few_panels_and_few_requests(sample_data: SampleData) -> None:
    with FaultyHttpService(sample_data) as flaky:
        flaky.set_mode("flaky503")
        with alerts_lookup(flaky.url) as lookup:
            results = fetch_many(lookup, callers=10, each=20, budget_s=2.0, pause_s=0.1)
        requests_made = flaky.requests_seen
    ok = [r for r in results if not isinstance(r, Exception)]
    assert len(ok) / len(results) >= 0.95, [r for r in results if isinstance(r, Exception)][:3]
    assert requests_made / len(results) <= 1.6


@pytest.mark.parametrize(
    "mode, requests_made, fails", [("error500", 1, True), ("flaky503", 2, False)]
)
def test_a_503_is_retried_and_a_500_is_not(
    sample_data: SampleData, mode: str, requests_made: int, fails: bool
) -> None:
    # A 503 says the service did not take the request: another attempt is safe. A 500 may
    # come after the service acted on it: the panel fails, retryable by the caller.
    with FaultyHttpService(sample_data) as service, alerts_lookup(service.url) as lookup:
        service.set_mode(mode)  # flaky503: the first answer only is a 503
        try:
            lookup.fetch(WINDOW, Deadline.after_s(2.0))
            failed = None
        except BackendUnavailable as error:
            failed = error
        assert service.requests_seen == requests_made
    assert (failed is not None) is fails
    if failed is not None:
        assert failed.retryable and not failed.retry_safe and "HTTP 500" in str(failed)


def test_healthy_backends_get_no_extra_requests(sample_data: SampleData) -> None:
    with FaultyHttpService(sample_data) as healthy, alerts_lookup(healthy.url) as lookup:
        results = fetch_many(lookup, callers=5, each=10, budget_s=2.0)
        assert healthy.requests_seen == len(results) == 50
    assert not any(isinstance(r, Exception) for r in results)


def test_retries_never_exceed_the_retry_budget() -> None:
    refused = f"http://127.0.0.1:{dead_port()}"  # every connect refused: always retry-safe
    with alerts_lookup(refused, breaker_failures=10_000, breaker_failure_rate=1.0) as lookup:
        began = time.monotonic()
        results = fetch_many(lookup, callers=4, each=50, budget_s=1.0)
        elapsed_s = time.monotonic() - began
    guard = lookup.backend.guard
    assert all(isinstance(r, Exception) for r in results) and len(results) == 200
    retries = guard.attempts - 200
    assert retries == guard.budget.retries > 0
    assert retries <= 0.2 * 200 + guard.budget.min_per_s * elapsed_s + guard.budget.max_tokens
    assert guard.budget.refused > 0


def test_the_breaker_opens_fails_fast_tries_one_call_and_closes() -> None:
    breaker = CircuitBreaker("test", BreakerPolicy(consecutive_failures=3, open_ms=100))
    for _ in range(3):
        assert breaker.check() is False
        breaker.record(failed=True)
    assert breaker.state is CircuitState.OPEN
    with pytest.raises(CircuitOpen) as fast:
        breaker.check()
    assert fast.value.retryable
    time.sleep(0.15)
    assert breaker.check() is True  # the one trial call
    with pytest.raises(CircuitOpen):
        breaker.check()  # others still fail fast meanwhile
    breaker.record(failed=True, trial=True)  # the trial failed: open again
    assert breaker.state is CircuitState.OPEN
    time.sleep(0.15)
    assert breaker.check() is True
    breaker.record(failed=False, trial=True)
    assert breaker.state is CircuitState.CLOSED and breaker.opened == 2


def test_the_failure_rate_opens_the_breaker_too() -> None:
    breaker = CircuitBreaker(
        "rate", BreakerPolicy(consecutive_failures=3, failure_rate=0.5, min_calls=10)
    )
    for n in range(10):
        breaker.check()
        breaker.record(failed=n % 3 != 2)  # 7 of 10, never three in a row
    assert breaker.state is CircuitState.OPEN


def call_all(client: AppStatsClient) -> tuple[Any, float]:
    began = time.monotonic()
    response = client.get_app_stats(
        "shop", SAMPLE_START_MS, SAMPLE_END_MS, PANELS, deadline_ms=8000
    )
    return response, time.monotonic() - began


def status_of(response: Any, panel: str) -> Any:
    return next(o for o in response.outcomes if o.name == panel)


@pytest.mark.solo  # its MongoDB panels queue 24 aggregations on the embedded server
def test_a_black_hole_opens_the_breaker_and_the_service_recovers(
    start_service: Any, sample_data: SampleData
) -> None:
    with FaultyHttpService(sample_data) as hole:
        # Without coalescing, so the six concurrent callers' calls each reach the hole. The
        # MongoDB panels get budgets that 24 aggregations queued on the embedded (serial)
        # server fit in on a loaded machine, and so does the calls' deadline (at its 2 s
        # default, a starved machine timed some out, and MongoDB's circuit opened too): the
        # test is about the hole's circuit alone.
        # The circuit stays open far longer than the calls below take on any machine; the
        # test then skips that time on the service's clock instead of waiting it out.
        clock = SkippingClock()
        service, client = start_service(
            clock=clock,
            **{
                "http.alerts_url": hole.url,
                "http.breaker_open_ms": 600_000,
                "fanout.coalesce": False,
                "fanout.request_deadline_ms": 8000,
                **{f"lookups.{p}.timeout_ms": 5000 for p in PANELS[:4]},
            },
        )
        hole.set_mode("hang")
        gevent.joinall([gevent.spawn(call_all, client) for _ in range(6)], timeout=30)

        seen = hole.requests_seen
        alerts = [status_of(call_all(client)[0], "alerts") for _ in range(5)]
        # Failing fast: a call the open circuit refused sent the hole nothing.
        refused = [a for a in alerts if a.error_type == "CircuitOpen"]
        assert len(refused) == 5
        assert all(a.status == appstats.TaskStatus.ERROR and a.retryable for a in refused)
        assert hole.requests_seen == seen
        response = call_all(client)[0]
        assert all(
            status_of(response, p).status == appstats.TaskStatus.OK for p in PANELS if p != "alerts"
        )
        circuits = {b.name: b.circuit for b in client.health().backends}
        assert circuits["alerts"] == "open" and circuits["mongo"] == "closed"

        hole.set_mode("ok")
        clock.skip(600)  # the open period passes: the next call is the trial
        healed = wait_for(
            lambda: all(o.status == appstats.TaskStatus.OK for o in call_all(client)[0].outcomes),
            20,
            "all seven panels OK after the service healed",
            poll_s=0.5,
        )
        assert healed
        assert service.fanout.wait_reapers(timeout_s=5) and service.fanout.inflight == 0
        wait_for(
            lambda: not any(service.backends.connections_in_use().values()),
            5,
            "every connection back in its pool",
        )


def test_a_restarted_mongo_costs_no_panel(start_service: Any, mongo_server: Any) -> None:
    with TcpFaultProxy(("127.0.0.1", mongo_server.port)) as proxy:
        # A patient budget, within the client's 5 s: the test is about the retry on a fresh
        # connection, and on a loaded machine a panel ran out of the default 1 s after it.
        service, client = start_service(
            **{
                "mongo.uri": f"mongodb://127.0.0.1:{proxy.address[1]}/?directConnection=true",
                "mongo.database": SAMPLE_DATABASE,
                "fanout.task_timeout_ms": 4000,
            }
        )
        assert all(o.status == appstats.TaskStatus.OK for o in call_all(client)[0].outcomes)
        proxy.reset_all()  # every pooled connection dies, as when the server restarts
        response, _ = call_all(client)
        assert all(o.status == appstats.TaskStatus.OK for o in response.outcomes), response.outcomes
        wait_for(lambda: service.backends.connections_in_use()["mongo"] == 0, 5, "mongo pool idle")


@pytest.fixture
def sometimes_slow() -> Iterator[dict[str, Any]]:
    """Alerts answering in 2 ms; once ``slow`` is set, every 10th request is held
    unanswered until ``release`` is set (or 5 s), then counted in ``slow_answered``."""
    from gevent.event import Event
    from gevent.pywsgi import WSGIServer

    state: dict[str, Any] = {
        "requests": 0,
        "slow": False,
        "held": 0,
        "slow_answered": 0,
        "release": Event(),
    }

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        state["requests"] += 1
        if state["slow"] and state["requests"] % 10 == 0:
            state["held"] += 1
            state["release"].wait(timeout=5)
            state["slow_answered"] += 1
        else:
            gevent.sleep(0.002)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"alerts": []}']

    server = WSGIServer(("127.0.0.1", 0), app, log=None)
    server.start()
    state["url"] = f"http://127.0.0.1:{server.server_port}"
    yield state
    state["release"].set()
    server.stop(timeout=1)


@pytest.mark.solo
def test_hedging_cuts_the_tail_without_leaking_slots(sometimes_slow: dict[str, Any]) -> None:
    backend_state = sometimes_slow
    with alerts_lookup(backend_state["url"], hedge=True) as lookup:
        for _ in range(40):  # learn the p95 (about 2 ms)
            lookup.fetch(WINDOW, Deadline.after_s(2.0))
        backend_state["slow"] = True
        answers = [lookup.fetch(WINDOW, Deadline.after_s(2.0)) for _ in range(30)]
        # Every fetch was answered while the slow answers were still held: by its hedge.
        assert backend_state["held"] >= 2 and backend_state["slow_answered"] == 0
        assert lookup.backend.guard.hedges >= backend_state["held"]
        assert all(answer == answers[0] for answer in answers)
        backend_state["release"].set()
        wait_for(
            lambda: backend_state["slow_answered"] == backend_state["held"],
            5,
            "the held answers given",
        )
    wait_for(lambda: lookup.backend.meter.in_use == 0, 2, "every HTTP slot given back")


def test_the_client_expires_idle_connections_before_the_server_does(start_server: Any) -> None:
    server = start_server()
    with AppStatsClient(*server.address, pool_size=1, max_idle_ms=100) as client:
        assert client.ping() == "pong"
        assert client.ping() == "pong"
        assert server.stats.connections_total == 1  # reused while fresh
        gevent.sleep(0.3)
        assert client.ping() == "pong"
        assert server.stats.connections_total == 2  # a new one, not the aged one


def test_each_attempt_shows_in_the_task_span(sample_data: SampleData, spans: Any) -> None:
    from opentelemetry import trace

    with FaultyHttpService(sample_data) as flaky, alerts_lookup(flaky.url) as lookup:
        flaky.set_mode("flaky503")  # the first request is a 503, the next is fine
        with trace.get_tracer("test").start_as_current_span("fanout.task alerts"):
            lookup.fetch(WINDOW, Deadline.after_s(2.0))
        assert flaky.requests_seen == 2
    (task,) = [s for s in spans.get_finished_spans() if s.name == "fanout.task alerts"]
    assert task.attributes["fanout.attempts"] == 2
    assert task.attributes["fanout.last_error"] == "BackendUnavailable"
    assert [e.attributes["attempt"] for e in task.events if e.name == "retry"] == [1]


def test_a_saturated_pool_of_our_own_does_not_open_the_backends_circuit(
    start_service: Any, mongo_server: Any
) -> None:
    with TcpFaultProxy(("127.0.0.1", mongo_server.port)) as proxy:
        service, client = start_service(
            **{
                "mongo.uri": f"mongodb://127.0.0.1:{proxy.address[1]}/?directConnection=true",
                "mongo.database": SAMPLE_DATABASE,
                "mongo.max_pool_size": 3,
                "fanout.task_timeout_ms": 400,
                "mongo.breaker_failures": 2,
                "fanout.coalesce": False,
            }
        )  # eight identical calls must each reach MongoDB
        call_all(client)  # connections made while the backend is quick
        proxy.set_delay_ms(150)  # slower, yet well within a task's budget
        calls = [gevent.spawn(call_all, client) for _ in range(8)]
        gevent.joinall(calls, timeout=30, raise_error=True)
        timed_out = [
            o
            for c in calls
            for o in c.value[0].outcomes
            if o.source == "mongo" and o.status == appstats.TaskStatus.TIMEOUT
        ]
        assert len(timed_out) >= 4  # most of them waited for one of two slots
        assert service.backends.mongo().guard.breaker.state is CircuitState.CLOSED
        assert {b.name: b.circuit for b in client.health().backends}["mongo"] == "closed"


def test_a_passing_health_check_closes_a_circuit_once_its_open_period_is_over() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("hc", BreakerPolicy(consecutive_failures=1, open_ms=2000), clock)
    breaker.check()
    breaker.record(failed=True)
    breaker.checked_healthy()  # within the open period: a ping is not a lookup
    assert breaker.state is CircuitState.OPEN
    clock.advance(2.0)
    breaker.checked_healthy()
    assert breaker.state is CircuitState.CLOSED and breaker.check() is False
    breaker.record(failed=True)
    clock.advance(2.0)
    assert breaker.check() is True  # a trial call in flight: it decides, not the check
    breaker.checked_healthy()
    assert breaker.state is CircuitState.HALF_OPEN


def test_an_idle_server_closes_a_recovered_backend_s_circuit_without_a_call(
    start_service: Any, sample_data: SampleData
) -> None:
    with FaultyHttpService(sample_data) as alerts:
        service, client = start_service(
            **{"http.alerts_url": alerts.url, "http.breaker_open_ms": 500}
        )
        alerts.set_mode("error500")
        while service.backends["alerts"].guard.breaker.state is not CircuitState.OPEN:
            client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["alerts"])
        guard = service.backends["alerts"].guard
        assert guard.failures == guard.calls > 0  # every call failed, and was counted
        alerts.set_mode("ok")
        started = service.fanout.stats.started
        wait_for(
            lambda: {b.name: b.circuit for b in client.health().backends}["alerts"] == "closed",
            20,
            "the health checks closing the alerts circuit",
            poll_s=0.5,
        )
        assert service.fanout.stats.started == started  # no call found it back


def test_a_worker_following_the_master_s_checks_closes_its_own_circuit() -> None:
    """In a group the master checks and each worker follows its rounds: a backend the master
    found up is a successful trial of the worker's circuit too."""
    from lookups.backends.collection import Backends
    from service.operations.health import BackendStatus, HealthChecker

    clock = FakeClock()
    settings = {"alerts": HttpBackendSettings(url="http://127.0.0.1:9", breaker_open_ms=1000)}
    with Backends(settings, clock=clock) as backends:
        breaker = backends["alerts"].guard.breaker
        for _ in range(breaker.policy.consecutive_failures):
            breaker.check()
            breaker.record(failed=True)
        checker = HealthChecker(backends, clock=clock)
        checker.follow([BackendStatus("alerts", False, 1.0, "HTTP 503")])
        clock.advance(1.0)
        checker.follow([BackendStatus("alerts", False, 1.0, "HTTP 503")])
        assert breaker.state is CircuitState.OPEN  # the master found it down
        checker.follow([BackendStatus("alerts", True, 1.0)])
        assert breaker.state is CircuitState.CLOSED
