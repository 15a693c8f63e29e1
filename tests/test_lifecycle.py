"""Shutdown: ``fanout serve`` as a real process under load, signalled while calls are in flight.

The alerts service runs in this process and *holds* every request it receives
until the test releases it, so the test knows the calls are in flight (they are
waiting at the backend) when it sends the signal, without guessing at timings.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import gevent
import gevent.event
import pytest
import requests
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TTransportException
from thriftpy2.transport.memory import TMemoryBuffer

from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData, SampleHttpServices
from service.settings.config import load_settings
from service.workers.lifecycle import GC_YOUNG_THRESHOLD, run_server
from tests.support.samples import backend_overrides
from tests.support.sockets import listening_addresses, wait_for
from tests.support.tracing import provider_of
from tracing.settings import TracingSettings
from tracing.setup import configure_tracing

CLIENTS = 30
#: Long enough for what the lame-duck tests check after SIGTERM to fall within it on a
#: starved machine.
LAME_DUCK_MS = 4000


def _ping_frame() -> bytes:
    buffer = TMemoryBuffer()
    proto = TBinaryProtocol(buffer)
    proto.write_message_begin("ping", TMessageType.CALL, 1)
    appstats.AppStats.ping_args().write(proto)
    proto.write_message_end()
    return struct.pack("!i", len(buffer.getvalue())) + buffer.getvalue()


PING_FRAME = _ping_frame()


class HeldAlerts:
    """Sample HTTP services whose alerts endpoint waits for :attr:`release` before answering."""

    def __init__(self, data: SampleData) -> None:
        self.services = SampleHttpServices(data).start()
        self.arrived = 0
        self.calls: set[Any] = set()
        self.enough = gevent.event.Event()
        self.expected = 1
        self.release = gevent.event.Event()
        answer = self.services.alerts.answer

        def held(segments: list[str], environ: dict[str, Any]) -> Any:
            # Calls, not requests: a lookup's retry of the same call is not one more in flight.
            trace_id = environ.get("HTTP_TRACEPARENT", "").split("-")[1:2] or [object()]
            self.calls.add(trace_id[0])
            self.arrived = len(self.calls)
            if self.arrived >= self.expected:
                self.enough.set()
            self.release.wait(timeout=60)
            return answer(segments, environ)

        # The real service, answering later.
        self.services.alerts.answer = held  # type: ignore[method-assign]

    def wait_for(self, count: int, timeout_s: float = 30) -> None:
        self.expected = count
        if self.arrived >= count:
            return
        assert self.enough.wait(timeout=timeout_s), f"{self.arrived} of {count} calls arrived"

    def stop(self) -> None:
        self.release.set()
        self.services.stop()


@pytest.fixture
def held(sample_data: SampleData) -> Iterator[HeldAlerts]:
    backend = HeldAlerts(sample_data)
    yield backend
    backend.stop()


def refused_within(port: int, timeout_s: float = 10) -> bool:
    """True once a new connection to ``port`` is refused (the listener has closed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            return True
        except ConnectionResetError:
            pass  # the listener closed with this connect in its queue; the next one is refused
        gevent.sleep(0.02)
    return False


def logged_count(log: str, pattern: str) -> int:
    match = re.search(pattern, log)
    assert match, f"{pattern!r} not in log:\n{log}"
    return int(match.group(1))


@pytest.mark.solo
def test_sigterm_under_load_finishes_every_call_in_flight(serve, held: HeldAlerts) -> None:
    # Without coalescing: every call in flight must reach the held alerts service.
    server = serve(held.services, **{"server.drain_timeout_ms": 10_000, "fanout.coalesce": False})
    clients = [AppStatsClient("127.0.0.1", server.port, timeout_ms=40_000) for _ in range(CLIENTS)]
    calls = [
        gevent.spawn(
            client.get_app_stats,
            "shop",
            SAMPLE_START_MS,
            SAMPLE_END_MS,
            ["alerts", "errors"],
            deadline_ms=30_000,
        )
        for client in clients
    ]
    held.wait_for(CLIENTS)

    signalled = server.signal(signal.SIGTERM)
    assert refused_within(server.port)
    held.release.set()

    responses = [call.get(timeout=30) for call in calls]  # raises if any call failed
    failed = [o for r in responses for o in r.outcomes if o.status != 0]
    assert not failed, failed
    assert server.wait(timeout_s=10 + 10) == 0
    exited_s = time.monotonic() - signalled
    assert exited_s < 10 + 5  # the drain timeout plus a margin
    log = server.log()
    assert "drain: SIGTERM received" in log
    assert logged_count(log, r"drain: stopped accepting; (\d+) calls in flight") == CLIENTS
    assert logged_count(log, r"drain: (\d+) calls finished in \d+ ms") == CLIENTS
    assert "drain: spans flushed" in log and "HTTP sessions closed" in log
    assert "Traceback" not in log
    for client in clients:
        client.close()


def test_sigint_closes_idle_connections_at_once(serve, http_services: SampleHttpServices) -> None:
    server = serve(http_services, **{"server.drain_timeout_ms": 30_000})
    idle = []
    for _ in range(3):
        client = AppStatsClient("127.0.0.1", server.port)
        assert client.ping() == "pong"
        idle.append(client)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    raw.sendall(PING_FRAME)
    assert raw.recv(4096)  # answered: the server is serving this connection, now idle

    signalled = server.signal(signal.SIGINT)
    assert raw.recv(1) == b""  # closed by the server, well before the 30 s drain timeout
    assert server.wait(timeout_s=20) == 0
    assert time.monotonic() - signalled < 15
    log = server.log()
    assert "drain: SIGINT received" in log
    assert logged_count(log, r"(\d+) idle connections closed") == 4
    assert logged_count(log, r"stopped accepting; (\d+) calls in flight") == 0
    raw.close()
    for client in idle:
        with pytest.raises(TTransportException):
            client.ping()  # the pooled connection was closed; no server to reconnect to
        client.close()


def test_drain_timeout_kills_a_stuck_call_and_still_exits_zero(serve, held: HeldAlerts) -> None:
    server = serve(
        held.services, **{"server.drain_timeout_ms": 500, "fanout.abandon_grace_ms": 200}
    )
    client = AppStatsClient("127.0.0.1", server.port, timeout_ms=40_000)
    stuck = gevent.spawn(
        client.get_app_stats, "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["alerts"], deadline_ms=30_000
    )
    held.wait_for(1)

    signalled = server.signal(signal.SIGTERM)
    with pytest.raises(TTransportException):
        stuck.get(timeout=20)  # its connection closed: a transport error, safe to retry elsewhere
    assert server.wait(timeout_s=20) == 0
    assert time.monotonic() - signalled < 10
    log = server.log()
    assert logged_count(log, r"stopped accepting; (\d+) calls in flight") == 1
    assert (
        logged_count(log, r"WARNING .*drain: timeout of 500 ms passed; .*?(\d+) connections") == 1
    )
    client.close()


def test_run_server_in_process_on_a_given_listener(mongo_server, http_services) -> None:
    settings = load_settings(
        env={},
        overrides={**backend_overrides(mongo_server, http_services), "tracing.enabled": False},
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    ready: list[tuple[str, int]] = []
    stop = gevent.event.Event()
    running = gevent.spawn(
        run_server,
        settings,
        listener=listener,
        on_ready=ready.append,
        install_signals=False,
        stop=stop,
    )
    try:
        with gevent.Timeout(10):
            while not ready:
                gevent.sleep(0.01)
        assert ready == [listener.getsockname()]
        with AppStatsClient(*ready[0]) as client:
            assert client.ping() == "pong"
        stop.set()
        assert running.get(timeout=20) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(ready[0], timeout=5)
    finally:
        running.kill()
        listener.close()


_TUNED_GC_PROBE = r"""
from gevent import monkey; monkey.patch_all()
import gc, gevent.event, json, sys
from service.settings.config import load_settings
from service.workers.lifecycle import GC_YOUNG_THRESHOLD, run_server
stop = gevent.event.Event()
before = (gc.get_threshold()[0], gc.get_freeze_count())
def ready(address):
    print(json.dumps({"before": before, "after": (gc.get_threshold()[0], gc.get_freeze_count())}))
    stop.set()
settings = load_settings(env={}, overrides={"server.port": 0, "tracing.enabled": False})
sys.exit(run_server(settings, on_ready=ready, install_signals=False, stop=stop,
                    tune_gc=sys.argv[1] == "tune"))
"""


@pytest.mark.parametrize("mode", ["tune", "embed"])
def test_a_serving_process_tunes_its_collector_and_an_embedding_one_is_left_alone(
    mode: str,
) -> None:
    shown = subprocess.run(
        [sys.executable, "-c", _TUNED_GC_PROBE, mode], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    figures = json.loads(shown.stdout.strip().splitlines()[-1])
    assert figures["before"] == [700, 0]
    if mode == "tune":
        assert figures["after"][0] == GC_YOUNG_THRESHOLD and figures["after"][1] > 1000
    else:
        assert figures["after"] == figures["before"]


def test_run_server_needs_a_way_to_stop() -> None:
    with pytest.raises(ValueError):
        run_server(load_settings(env={}), install_signals=False)


@pytest.mark.parametrize("collector", ["refused", "silent"])
def test_span_flush_at_shutdown_is_bounded_when_the_collector_is_down(collector: str) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    if collector == "silent":
        holder.listen(8)  # accepts TCP connections, never answers
    port = holder.getsockname()[1]
    try:
        tracing = configure_tracing(
            TracingSettings(
                exporter="otlp", otlp_protocol="http/protobuf", endpoint=f"http://127.0.0.1:{port}"
            ),
            set_global=False,
            env={},
        )
        for index in range(5):
            provider_of(tracing).get_tracer("test").start_span(f"pending {index}").end()
        started = time.monotonic()
        assert tracing.shutdown(timeout_ms=300) is False
        # The exporter alone would retry for its 10 s timeout.
        assert time.monotonic() - started < 3.0
    finally:
        holder.close()


def test_a_lame_duck_reports_draining_while_still_serving(
    serve, http_services: SampleHttpServices
) -> None:
    server = serve(http_services, **{"server.lame_duck_ms": LAME_DUCK_MS})
    with AppStatsClient("127.0.0.1", server.port) as client:
        assert client.health().state == appstats.ServingState.SERVING
    signalled = server.signal(signal.SIGTERM)
    with AppStatsClient("127.0.0.1", server.port) as late:  # a new connection is still accepted
        assert wait_for(
            lambda: late.health().state == appstats.ServingState.DRAINING,
            5,
            "DRAINING during the lame-duck period",
        )
        assert late.ping() == "pong"
    assert time.monotonic() - signalled < LAME_DUCK_MS / 1000
    assert refused_within(server.port)
    assert time.monotonic() - signalled >= LAME_DUCK_MS / 1000
    assert server.wait(timeout_s=20) == 0
    assert f"lame duck for {LAME_DUCK_MS} ms" in server.log()


def test_http_probes_answer_live_and_ready_and_not_ready_while_draining(
    serve, http_services: SampleHttpServices
) -> None:
    server = serve(http_services, **{"server.probe_port": 0, "server.lame_duck_ms": LAME_DUCK_MS})
    found = wait_for(
        lambda: re.search(r"probes: (http://\S+)/healthz", server.log()),
        10,
        "the probe address in the log",
    )
    base = found.group(1)
    # The loop's first round of backend checks reaches the probes' bodies shortly after start.
    ready = wait_for(
        lambda: (r := requests.get(f"{base}/readyz", timeout=5)).json()["backends"] and r,
        5,
        "the first backend checks in /readyz",
    )
    live = requests.get(f"{base}/healthz", timeout=5)
    assert live.status_code == 200 and live.json()["status"] == "ok"
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert set(ready.json()["backends"]) == {"mongo", "alerts", "metrics"}
    assert requests.get(f"{base}/nope", timeout=5).status_code == 404

    server.signal(signal.SIGTERM)
    draining = wait_for(
        lambda: requests.get(f"{base}/readyz", timeout=5).status_code == 503,
        5,
        "/readyz 503 in the lame-duck period",
    )
    assert draining
    assert requests.get(f"{base}/readyz", timeout=5).json()["status"] == "draining"
    assert requests.get(f"{base}/healthz", timeout=5).status_code == 200  # still alive
    assert server.wait(timeout_s=20) == 0


def test_a_backend_down_is_reported_but_readiness_stays(
    serve, http_services: SampleHttpServices
) -> None:
    """One backend down: /readyz stays 200 (every replica shares the backend), and the
    backend shows as down in /readyz's and /healthz's bodies and the fanout.backend.up gauge."""
    server = serve(
        http_services,
        **{
            "server.probe_port": 0,
            "mongo.uri": "mongodb://127.0.0.1:1",
            "metrics.exporter": "prometheus",
            "metrics.port": 0,
        },
    )
    found = wait_for(
        lambda: re.search(r"probes: (http://\S+)/healthz", server.log()),
        10,
        "the probe address in the log",
    )
    ready = wait_for(
        lambda: (r := requests.get(f"{found.group(1)}/readyz", timeout=5)).json()["backends"] and r,
        5,
        "the first backend checks in /readyz",
    )
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    assert ready.json()["backends"]["mongo"]["up"] is False
    assert ready.json()["backends"]["alerts"]["up"] is True
    live = requests.get(f"{found.group(1)}/healthz", timeout=5).json()
    assert live["status"] == "ok" and live["backends"]["mongo"]["up"] is False
    scrape_url = wait_for(
        lambda: re.search(r"Prometheus scrape at (http://\S+/metrics)", server.log()),
        10,
        "the scrape address in the log",
    ).group(1)
    scrape = requests.get(scrape_url, timeout=5).text
    # fanout_backend names a backend as every metric, pool and health() does.
    assert re.search(r'^fanout_backend_up\{fanout_backend="mongo".*\} 0\.0$', scrape, re.M), scrape
    assert re.search(r'^fanout_backend_up\{fanout_backend="alerts".*\} 1\.0$', scrape, re.M), scrape
    assert re.search(r'^fanout_circuit_state\{fanout_backend="alerts".*\} ', scrape, re.M), scrape
    assert re.search(r'^fanout_pool_size\{fanout_pool_name="alerts".*\} 32\.0$', scrape, re.M), (
        scrape
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_probes_and_metrics_listen_on_hosts_of_their_own(
    serve, http_services: SampleHttpServices, workers: int
) -> None:
    """Thrift on 127.0.0.1, probes on 127.0.0.2, metrics on 127.0.0.3 (all loopback): each
    answers on its own host only, in one process and with the master serving a group's."""
    server = serve(
        http_services,
        **{
            "server.workers": workers,
            "server.probe_port": 0,
            "server.probe_host": "127.0.0.2",
            "metrics.exporter": "prometheus",
            "metrics.host": "127.0.0.3",
            "metrics.port": 0,
        },
    )
    probes = wait_for(
        lambda: re.search(r"(?:probes: |group probes on )http://([\d.]+):(\d+)", server.log()),
        10,
        "the probe address in the log",
    )
    scrape = wait_for(
        lambda: re.search(
            r"(?:Prometheus scrape at |group metrics on )http://([\d.]+):(\d+)", server.log()
        ),
        10,
        "the scrape address in the log",
    )
    assert (probes.group(1), scrape.group(1)) == ("127.0.0.2", "127.0.0.3"), server.log()
    probe_port, scrape_port = int(probes.group(2)), int(scrape.group(2))
    assert requests.get(f"http://127.0.0.2:{probe_port}/healthz", timeout=5).status_code == 200
    assert "fanout_" in requests.get(f"http://127.0.0.3:{scrape_port}/metrics", timeout=5).text
    # Nothing of the server's listens on those ports on any other host (127.0.0.1, 0.0.0.0, ::).
    listening = listening_addresses(server.process.pid)
    assert {host for host, port in listening if port == probe_port} == {"127.0.0.2"}, listening
    assert {host for host, port in listening if port == scrape_port} == {"127.0.0.3"}, listening
    assert ("127.0.0.1", server.port) in listening
    with AppStatsClient("127.0.0.1", server.port, timeout_ms=5000) as client:
        assert client.ping() == "pong"
