"""Probes and the Prometheus scrape answer while the event loop that runs calls cannot.

The endpoints run in this test process; its main thread then blocks the event
loop (waiting natively, as a greenlet computing or stuck in unpatched code
would) until a native thread has its answer. Served from the loop, no answer
could come before the block ends, and the wait would run out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
from gevent import monkey
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry

from lookups.backends.collection import Backends
from service.operations.health import HealthChecker
from service.operations.metrics_endpoint import COLLECT_TIMEOUT_S, MetricsEndpoint
from service.operations.native_http import native_lock
from service.operations.probes import ProbeServer
from service.samples import MongoWireServer, SampleHttpServices
from service.settings.config import load_settings
from tests.support.samples import backend_overrides

_NativeSocket = monkey.get_original("socket", "socket")
_start_thread = monkey.get_original("_thread", "start_new_thread")
_BLOCK_S = 5.0


def _get(port: int, path: str) -> tuple[int, str]:
    """A GET with the original, unpatched socket: usable from any native thread."""
    sock = _NativeSocket()
    sock.settimeout(_BLOCK_S)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: test\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    finally:
        sock.close()
    head, _, body = b"".join(chunks).decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def answered_while_the_loop_is_blocked(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` from a native thread while this thread blocks the event loop."""
    answered = native_lock()
    answered.acquire()
    result: list[Any] = []

    def fetch() -> None:
        try:
            result.append(_get(port, path))
        except OSError as exc:
            result.append(exc)
        finally:
            answered.release()

    _start_thread(fetch, ())
    # A native wait: no greenlet of this thread's loop runs until it ends.
    assert answered.acquire(timeout=_BLOCK_S), f"{path}: no answer while the event loop was blocked"
    (outcome,) = result
    assert not isinstance(outcome, OSError), outcome
    return outcome


@pytest.fixture
def health(
    mongo_server: MongoWireServer, http_services: SampleHttpServices
) -> Iterator[HealthChecker]:
    settings = load_settings(env={}, overrides=backend_overrides(mongo_server, http_services))
    clients = Backends(settings.backends, settings.lookups)
    checker = HealthChecker(clients)
    yield checker
    clients.close()


def test_probes_answer_while_the_event_loop_is_blocked(health: HealthChecker) -> None:
    draining = [False]
    probes = ProbeServer("127.0.0.1", 0, health, lambda: draining[0]).start()
    try:
        port = probes.address[1]
        status, body = answered_while_the_loop_is_blocked(port, "/healthz")
        assert status == 200 and '"status": "ok"' in body
        assert answered_while_the_loop_is_blocked(port, "/readyz")[0] == 200
        draining[0] = True
        status, body = answered_while_the_loop_is_blocked(port, "/readyz")
        assert status == 503 and '"status": "draining"' in body
    finally:
        probes.stop()


def test_a_loop_silent_past_its_limit_is_not_live(health: HealthChecker) -> None:
    probes = ProbeServer("127.0.0.1", 0, health, lambda: False, stale_after_s=0.001).start()
    try:
        probes._beat -= 60.0  # as if the loop had not run for a minute
        status, body = answered_while_the_loop_is_blocked(probes.address[1], "/healthz")
        assert status == 503 and "event loop silent" in body
    finally:
        probes.stop()


def test_a_scrape_answers_while_the_event_loop_is_blocked_with_the_last_values() -> None:
    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    calls = provider.get_meter("test").create_counter("test.calls")
    endpoint = MetricsEndpoint(registry, "127.0.0.1", 0).start()
    try:
        calls.add(3)
        status, fresh = _scrape_from_the_loop(endpoint)
        assert status == 200 and re.search(r"^test_calls_total\{.*\} 3\.0$", fresh, re.M), fresh
        calls.add(4)  # not collected: the loop that would collect is blocked below
        status, body = answered_while_the_loop_is_blocked(endpoint.address[1], "/metrics")
        assert status == 200 and re.search(r"^test_calls_total\{.*\} 3\.0$", body, re.M), body
        assert f"did not collect within {COLLECT_TIMEOUT_S} s" in body
        assert answered_while_the_loop_is_blocked(endpoint.address[1], "/nope")[0] == 404
    finally:
        endpoint.stop()
        provider.shutdown()


def _scrape_from_the_loop(endpoint: MetricsEndpoint) -> tuple[int, str]:
    """A scrape while the loop runs: the collection happens on it, fresh."""
    fetch = gevent.get_hub().threadpool.spawn(_get, endpoint.address[1], "/metrics")
    return fetch.get(timeout=_BLOCK_S)
