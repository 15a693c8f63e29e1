"""health(): serving state and backend reachability, against real backends and real failures."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.thrift import TClient, TMessageType
from thriftpy2.transport.framed import TCyFramedTransport
from thriftpy2.transport.memory import TMemoryBuffer

from lookups.backends.collection import Backends
from service.app import FanOutService
from service.client import AppStatsClient
from service.idl import appstats
from service.operations.health import HealthChecker
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, MongoWireServer, SampleHttpServices
from service.samples.http_services import serve_wsgi
from service.settings.config import Settings, load_settings
from service.testing import FakeClock
from tests.support.samples import SAMPLE_DATABASE, backend_overrides
from tests.support.sockets import wait_for

State = appstats.ServingState
FANOUT = [sys.executable, "-m", "service.cli"]


def settings_for(mongo_uri: str, alerts_url: str, metrics_url: str, **extra: Any) -> Settings:
    return load_settings(
        env={},
        overrides={
            "mongo.uri": mongo_uri,
            "mongo.database": SAMPLE_DATABASE,
            "http.alerts_url": alerts_url,
            "http.metrics_url": metrics_url,
            "server.port": 0,
            **extra,
        },
    )


@pytest.fixture
def start_with_settings(mongo_server, http_services) -> Iterator[Callable[..., FanOutService]]:
    started: list[FanOutService] = []

    def start(settings: Settings | None = None) -> FanOutService:
        settings = settings or load_settings(
            env={}, overrides={**backend_overrides(mongo_server, http_services), "server.port": 0}
        )
        service = FanOutService(settings).start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop(timeout_s=5.0)


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port nothing listens on (held bound, not listening, so nobody else takes it)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that completes TCP connections (kernel backlog) but never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.fixture
def failing_http() -> Iterator[str]:
    """An HTTP service that answers every request with 503."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("503 Service Unavailable", [("Content-Length", "0")])
        return [b""]

    server = serve_wsgi(app)
    yield f"http://127.0.0.1:{server.server_port}"
    server.stop(timeout=1)


def by_name(health: Any) -> dict[str, Any]:
    return {backend.name: backend for backend in health.backends}


def all_up(health: Any) -> Any:
    """``health`` when every backend in it is up, else None."""
    return health if all(backend.up for backend in health.backends) else None


def test_all_backends_up(start_with_settings) -> None:
    service = start_with_settings()
    with AppStatsClient(*service.address) as client:
        # A check with no answer within its budget is reported down: beside two CPU hogs
        # the first MongoDB connection took longer. Up once it is made.
        health = wait_for(
            lambda: all_up(client.health()),
            timeout_s=20,
            what="every backend reported up",
            poll_s=0.5,
        )
    assert health.state == State.SERVING
    assert [b.name for b in health.backends] == ["mongo", "alerts", "metrics"]
    for backend in health.backends:
        assert backend.up and backend.detail is None and 0 <= backend.latency_ms < 5000


def test_mongo_down_is_reported_without_credentials(
    start_with_settings, http_services, dead_port
) -> None:
    uri = f"mongodb://fanout:hunter2@127.0.0.1:{dead_port}/?authSource=admin"
    service = start_with_settings(
        settings_for(uri, http_services.alerts_url, http_services.metrics_url)
    )
    started = time.monotonic()
    with AppStatsClient(*service.address) as client:
        health = client.health()
    assert time.monotonic() - started < 3.0  # bounded by the check timeout, not pymongo's defaults
    backends = by_name(health)
    assert not backends["mongo"].up and backends["mongo"].detail
    assert "hunter2" not in backends["mongo"].detail and "fanout:" not in backends["mongo"].detail
    assert backends["alerts"].up and backends["metrics"].up
    assert health.state == State.SERVING


def test_stopped_mongo_and_failing_http_services(sample_data, failing_http, dead_port) -> None:
    """Up, then the MongoDB-wire server stops: down once the cached answer expires."""
    clock = FakeClock(0.0)
    with MongoWireServer() as mongo:
        settings = settings_for(mongo.uri, failing_http, f"http://127.0.0.1:{dead_port}")
        with Backends(settings.backends) as backends:
            # A patient budget: beside two CPU hogs the first server selection took longer
            # than the default 300 ms, and the server that was up was reported down.
            checker = HealthChecker(backends, timeout_ms=2000, clock=clock)
            first = {s.name: s for s in checker.check()}
            assert first["mongo"].up
            assert (first["alerts"].up, first["alerts"].detail) == (False, "HTTP 503")
            assert not first["metrics"].up and first["metrics"].detail.startswith("cannot connect")

            mongo.stop()
            assert {s.name: s for s in checker.check()} == first  # cached: no new round of checks
            clock.advance(1.0)
            after = {s.name: s for s in checker.check()}

    assert not after["mongo"].up and after["mongo"].detail.startswith("cannot connect"), after


def test_a_mongodb_port_refusing_connections_is_reported_as_such_within_the_round(
    http_services, dead_port
) -> None:
    """Not as a timeout: pymongo's server selection ends past the check's 300 ms (it looks
    again every half second), and the round waits for the reason it recorded."""
    settings = settings_for(
        f"mongodb://127.0.0.1:{dead_port}", http_services.alerts_url, http_services.metrics_url
    )
    with Backends(settings.backends) as backends:
        checker = HealthChecker(backends, timeout_ms=300, cache_ms=0)
        checker.check()  # the first round also starts pymongo's monitor: the rounds after
        mongo = next(s for s in checker.check() if s.name == "mongo")
    assert mongo.detail == "cannot connect (no server accepts connections)", mongo
    assert mongo.latency_ms < 300 + 600


def test_checks_run_in_parallel_each_with_its_own_timeout(backend_settings, silent_port) -> None:
    """Three backends that accept connections and never answer: about one timeout, not three."""
    silent = f"http://127.0.0.1:{silent_port}"
    settings = settings_for(f"mongodb://127.0.0.1:{silent_port}", silent, silent)
    with Backends(settings.backends) as backends:
        checker = HealthChecker(backends, timeout_ms=2000)
        started = time.monotonic()
        statuses = checker.check()
        elapsed = time.monotonic() - started

    assert [s.up for s in statuses] == [False, False, False]
    assert all("no answer within 2000 ms" in s.detail for s in statuses), statuses
    assert elapsed < 5.0  # in sequence they would take at least 6 s


def test_concurrent_callers_share_one_round_of_checks(backends) -> None:
    # A patient budget: beside two CPU hogs the first server selection took longer than 300 ms.
    checker = HealthChecker(backends, timeout_ms=2000)
    results = [g.get(timeout=10) for g in [gevent.spawn(checker.check) for _ in range(20)]]
    assert all(result is results[0] for result in results)
    assert all(status.up for status in results[0])


def test_checks_are_not_traced(backends, spans) -> None:
    checker = HealthChecker(backends)
    assert all(status.up for status in checker.check())
    assert spans.get_finished_spans() == ()


def _frame(method: str, args: Any) -> bytes:
    buffer = TMemoryBuffer()
    proto = TBinaryProtocol(buffer)
    proto.write_message_begin(method, TMessageType.CALL, 9)
    args.write(proto)
    proto.write_message_end()
    payload = buffer.getvalue()
    return struct.pack("!i", len(payload)) + payload


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, size: int) -> bytes:
        return self._sock.recv(size)


def test_health_answers_draining_while_a_call_keeps_the_drain_going(
    start_with_settings, mongo_server, sample_data
) -> None:
    slow = SampleHttpServices(sample_data, alerts_delay_ms=1500).start()
    try:
        service = start_with_settings(
            load_settings(
                env={},
                overrides={
                    **backend_overrides(mongo_server, slow),
                    "server.port": 0,
                    "fanout.task_timeout_ms": 5000,
                    "fanout.request_deadline_ms": 5000,
                    "http.read_timeout_ms": 5000,
                },
            )
        )
        busy = AppStatsClient(*service.address, timeout_ms=8000)
        in_flight = gevent.spawn(
            busy.get_app_stats, "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["alerts"], deadline_ms=5000
        )
        # Another connection has begun sending a health call when the drain starts.
        health_call = _frame("health", appstats.AppStats.health_args())
        other = socket.create_connection(service.address, timeout=10)
        other.sendall(health_call[:3])
        gevent.sleep(0.3)  # the slow call reaches the alerts service

        draining = gevent.spawn(service.drain, 10.0)
        gevent.sleep(0.1)
        assert service.server.draining and not draining.ready()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(service.address, timeout=5)

        other.sendall(health_call[3:])
        reply = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Reader(other))))
        assert reply._recv("health").state == State.DRAINING
        assert other.recv(1) == b""  # closed after its one call
        other.close()

        response = in_flight.get(timeout=10)
        assert [o.status for o in response.outcomes] == [appstats.TaskStatus.OK]
        report = draining.get(timeout=10)
        assert (report.calls_in_flight, report.killed) == (2, 0)
        busy.close()
    finally:
        slow.stop()


def test_cli_call_health(start_with_settings) -> None:
    service = start_with_settings()
    # What is shown, once every backend has answered a check: a first check on a machine
    # whose cores other work takes may find MongoDB's first connection slower than 300 ms.
    wait_for(lambda: all(status.up for status in service.health.check()), 30, "all up")
    port = str(service.address[1])
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
    as_json = subprocess.run(
        [*FANOUT, "call", "health", "--port", port, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert body["state"] == "SERVING"
    assert [(b["name"], b["up"], b["detail"]) for b in body["backends"]] == [
        ("mongo", True, ""),
        ("alerts", True, ""),
        ("metrics", True, ""),
    ]
    text = subprocess.run(
        [*FANOUT, "call", "health", "--port", port],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert text.returncode == 0 and "SERVING" in text.stdout and "metrics" in text.stdout


def test_an_http_backend_answering_404_at_its_url_is_down_and_health_path_is_checked(
    http_services,
) -> None:
    # The sample alerts service answers its base URL, and 404 for a path it does not have.
    nothing_there = f"{http_services.alerts_url}/no/such/service"
    settings = load_settings(
        env={},
        overrides={
            "backends.alerts.kind": "http",
            "backends.alerts.url": http_services.alerts_url,
            "backends.wrong.kind": "http",
            "backends.wrong.url": nothing_there,
            "backends.checked.kind": "http",
            "backends.checked.url": http_services.metrics_url,
            "backends.checked.health_path": "/no/such/path",
        },
    )
    with Backends(settings.backends) as backends:
        statuses = {s.name: s for s in HealthChecker(backends, timeout_ms=2000).check()}
    assert statuses["alerts"].up
    assert (statuses["wrong"].up, statuses["wrong"].detail) == (False, "HTTP 404")
    assert (statuses["checked"].up, statuses["checked"].detail) == (False, "HTTP 404")
