"""The shipped rules and dashboard against a real Prometheus scraping a real two-worker
``fanout serve`` under load: with TLS, the results cache on Redis, and a backend killed
and brought back. Every dashboard query returns data, the backend alert fires and
clears (each alert's ``for:`` shortened: :mod:`tests.support.prometheus`), and the group's
probes show Redis down and back."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.samples.faults import TcpFaultProxy
from service.samples.mongo_server import free_port
from tests.support.group import (  # noqa: F401 (a fixture)
    all_serving,
    group_env,
    group_ports,
    probe,
)
from tests.support.pki import Pki, make_pki
from tests.support.prometheus import PrometheusServer
from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (a fixture)
from tests.support.sockets import wait_for
from tests.support.toolchains import needs
from tests.support.workers import Server, serve  # noqa: F401 (a fixture)

pytestmark = [needs("prometheus"), needs("redis")]

ROOT = Path(__file__).resolve().parent.parent
RULE_FILES = sorted((ROOT / "deploy" / "monitoring" / "rules").glob("*.rules.yaml"))
HOUR_MS = 3_600_000


def _dashboard_queries() -> list[str]:
    """Every query of the shipped dashboard, with Grafana's variables as Grafana would set
    them: every instance, and a rate interval of a few scrapes."""
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy/grafana/dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [
        query.replace("$instance", ".+").replace("$__rate_interval", "10s")
        for query in module.queries()
    ]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
def prometheus_for(group_ports: dict[str, int]) -> Iterator[Callable[[], PrometheusServer]]:
    started: list[PrometheusServer] = []

    def start() -> PrometheusServer:
        started.append(PrometheusServer(f"127.0.0.1:{group_ports['metrics']}", RULE_FILES))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _call_on(address: tuple[str, int], pki: Pki, calling: list[bool]) -> None:
    with AppStatsClient(*address, timeout_ms=10_000, tls_ca_file=pki.ca_file) as client:
        while calling[0]:
            try:
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=3_000)
            except Exception:
                pass
            gevent.sleep(0.05)


def _refused_handshake(address: tuple[str, int]) -> None:
    """A client speaking plain bytes to the TLS port: one refused handshake."""
    with socket.create_connection(address, timeout=5) as plain:
        plain.sendall(b"\x80\x01\x00\x01 not TLS at all")
        try:
            plain.recv(1024)  # until the server closes it
        except ConnectionResetError:
            pass  # closed with unread bytes: a reset


def _missing(prometheus: PrometheusServer, queries: list[str], seen: set[str]) -> list[str]:
    for query in queries:
        if query not in seen and prometheus.query(query):
            seen.add(query)
    return [query for query in queries if query not in seen]


def test_the_dashboard_and_the_backend_alert_work_on_a_real_scrape(
    serve: Callable[..., Server],
    group_ports: dict[str, int],
    mongo_server: Any,
    redis_server: RedisServer,
    pki: Pki,
    prometheus_for: Callable[[], PrometheusServer],
) -> None:
    port = free_port()
    target = ("127.0.0.1", mongo_server.port)
    proxy = TcpFaultProxy(target, port=port).start()
    env = {
        **group_env(group_ports),
        "FANOUT_MONGO_URI": f"mongodb://127.0.0.1:{port}",
        "FANOUT_SERVER_TLS_CERT_FILE": pki.cert_file,
        "FANOUT_SERVER_TLS_KEY_FILE": pki.key_file,
        "FANOUT_CACHE_ENABLED": "true",
        "FANOUT_CACHE_URL": redis_server.url,
        "FANOUT_CACHE_BUCKET_MS": str(HOUR_MS),
        "FANOUT_CACHE_SETTLE_MS": "0",
    }
    server = serve("--workers", "2", env=env)
    calling = [True]
    callers: list[gevent.Greenlet] = []
    try:
        wait_for(lambda: all_serving(group_ports, 2), 30, "both workers serving")
        prometheus = prometheus_for()
        wait_for(prometheus.targets_up, 30, "Prometheus scraping the group")
        callers = [gevent.spawn(_call_on, server.address, pki, calling) for _ in range(4)]
        _refused_handshake(server.address)
        queries, seen = _dashboard_queries(), set[str]()
        proxy.stop()  # MongoDB gone: its panels fail, its health check says down

        def backend_down() -> list[dict[str, Any]]:
            _missing(prometheus, queries, seen)  # the queries of failures have data now
            return [
                a for a in prometheus.alerts() if a["labels"]["alertname"] == "FanoutBackendDown"
            ]

        down = wait_for(backend_down, 60, "FanoutBackendDown firing")
        assert {alert["labels"]["fanout_backend"] for alert in down} == {"mongo"}, down
        assert down[0]["labels"]["severity"] == "page", down
        assert down[0]["annotations"]["runbook_url"].endswith("#fanoutbackenddown"), down
        proxy = TcpFaultProxy(target, port=port).start()
        try:
            wait_for(lambda: not _missing(prometheus, queries, seen), 60, "every query's data")
        except AssertionError:
            pytest.fail(f"dashboard queries with no data: {_missing(prometheus, queries, seen)}")

        # The results cache's Redis beside the backends in the group's probes, as the workers
        # last found it.
        def cache_up() -> bool:
            return bool(probe(group_ports, "/readyz").json()["backends"]["cache"]["up"])

        redis_server.pause()
        try:
            wait_for(lambda: not cache_up(), 30, "the group's probes showing Redis down")
        finally:
            redis_server.resume()
        wait_for(cache_up, 30, "the group's probes showing Redis up again")
        wait_for(
            lambda: (
                not [
                    a
                    for a in prometheus.alerts("firing") + prometheus.alerts("pending")
                    if a["labels"]["alertname"] == "FanoutBackendDown"
                ]
            ),
            60,
            "FanoutBackendDown cleared",
        )
    finally:
        calling[0] = False
        gevent.joinall(callers, timeout=15)
        proxy.stop()
    assert server.stop() == 0
