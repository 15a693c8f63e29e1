"""Overload: running out of file descriptors, and a burst of calls far over the task budget.

"Stops accepting past server.max_connections, resumes when one closes" is
tests/test_server.py::test_connections_past_the_limit_wait_until_one_closes.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.thrift import TClient
from thriftpy2.transport import TSocket
from thriftpy2.transport.framed import TCyFramedTransport

from service.app import FanOutService
from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData, SampleHttpServices
from service.settings.config import load_settings
from service.wire.accept import fd_headroom_warning
from tests.support.samples import backend_overrides

ROOT = Path(__file__).resolve().parent.parent

# A ping-only Thrift server with a low open-files limit. It prints its port, serves
# until its stdin closes (or 60 s pass), then stops and exits 0.
_LOW_FD_SERVER = r"""
import resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
from gevent import monkey; monkey.patch_all()
import logging
import gevent.socket
from thriftpy2.thrift import TProcessor
from service.wire.accept import ResilientStreamServer
from service.settings.server import ServerSettings
from service.idl import appstats
from service.listener.server import ThriftServer

class Pinger:
    def ping(self):
        return "pong"

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
ResilientStreamServer.warn_interval_s = 600.0  # longer than the test: exactly one warning
server = ThriftServer(TProcessor(appstats.AppStats, Pinger()), ServerSettings(port=0))
server.start()
print(server.address[1], flush=True)
gevent.socket.wait_read(sys.stdin.fileno(), timeout=60)
server.stop(5.0)
"""
_FD_LIMIT = 64
_CLIENTS = 120  # well over the limit, and under the listen backlog (128) plus what is accepted


def ping_over(sock: socket.socket) -> str:
    sock.settimeout(10)
    return TClient(
        appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(TSocket(sock=sock)))
    ).ping()


def connect_and_ping(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        return ping_over(sock)


def read_until(stream: Any, marker: str, seen: list[str], timeout_s: float = 20.0) -> None:
    """Read lines of ``stream`` into ``seen`` until one contains ``marker``."""
    with gevent.Timeout(timeout_s, AssertionError(f"no {marker!r} in: {seen}")):
        while not any(marker in line for line in seen):
            line = stream.readline()
            assert line, f"stream ended without {marker!r}: {seen}"
            seen.append(line)


def test_running_out_of_file_descriptors_pauses_accepting_and_recovers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOW_FD_SERVER, str(_FD_LIMIT)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    clients: list[socket.socket] = []
    try:
        with gevent.Timeout(30):
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
        log: list[str] = []
        clients = [
            socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(_CLIENTS)
        ]
        read_until(proc.stderr, "accept() failed", log)
        assert ping_over(clients[0]) == "pong"  # connections already accepted are still served

        for sock in clients:
            sock.close()
        assert connect_and_ping(port) == "pong"  # accepting resumed by itself

        assert proc.stdin is not None
        proc.stdin.close()
        _, rest = proc.communicate(timeout=20)
        log.extend(rest.splitlines())
        assert proc.returncode == 0, log
    finally:
        for sock in clients:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    warnings = [line for line in log if "accept() failed" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING"), log
    assert "Too many open files" in warnings[0]
    assert any("open-files limit is 64" in line for line in log), log  # said at start-up
    assert any("accepting connections again after" in line for line in log), log
    assert not any("Traceback" in line for line in log), log


def test_start_up_warns_when_max_connections_exceeds_the_open_files_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        assert fd_headroom_warning(10**9) == ""
        return
    assert "ulimit -n" in fd_headroom_warning(soft)
    if soft > 100:
        assert fd_headroom_warning(soft - 100) == ""


@pytest.fixture
def slow_http(sample_data: SampleData) -> Iterator[SampleHttpServices]:
    services = SampleHttpServices(sample_data, alerts_delay_ms=200, metrics_delay_ms=200).start()
    yield services
    services.stop()


_BURST = 200
_QUEUE_TIMEOUT_MS = 3_000
_DEADLINE_MS = 6_000


@pytest.mark.solo
def test_burst_far_over_the_task_budget_gets_answers_or_overloaded_fast(
    mongo_server: Any, slow_http: SampleHttpServices
) -> None:
    settings = load_settings(
        env={},
        overrides={
            **backend_overrides(mongo_server, slow_http),
            "server.port": 0,
            "fanout.max_inflight_tasks": 8,
            "fanout.pool_size": 4,
            "fanout.queue_timeout_ms": _QUEUE_TIMEOUT_MS,
            "fanout.request_deadline_ms": _DEADLINE_MS,
        },
    )
    service = FanOutService(settings).start()
    clients = [
        AppStatsClient(
            *service.address, pool_size=1, timeout_ms=_DEADLINE_MS, overload_retry_ratio=0
        )
        for _ in range(_BURST)
    ]

    def call(client: AppStatsClient) -> tuple[str, float, Any]:
        began = time.monotonic()
        try:
            answer: Any = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
        except appstats.Overloaded as overloaded:
            answer = overloaded
        return type(answer).__name__, time.monotonic() - began, answer

    try:
        calls = [gevent.spawn(call, client) for client in clients]
        gevent.joinall(calls, timeout=_DEADLINE_MS / 1000.0 + 10.0)
        assert all(c.ready() for c in calls), "a call hung"
        results = [c.get() for c in calls]  # re-raises a transport error, if any

        kinds = {kind for kind, _, _ in results}
        assert kinds == {"StatsResponse", "Overloaded"}, kinds
        overloaded = [
            (elapsed, answer) for kind, elapsed, answer in results if kind == "Overloaded"
        ]
        assert all(answer.retry_after_ms > 0 for _, answer in overloaded)
        # Fail fast: rejected without waiting for a slot (queue_timeout_ms).
        slowest = max(elapsed for elapsed, _ in overloaded)
        assert slowest < _QUEUE_TIMEOUT_MS / 1000.0, slowest

        assert service.fanout.wait_reapers(timeout_s=5)
        assert service.fanout.inflight == 0
        assert service.backends.connections_in_use() == {"mongo": 0, "alerts": 0, "metrics": 0}
        with AppStatsClient(*service.address, timeout_ms=_DEADLINE_MS) as after:
            again = after.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
        assert {o.status for o in again.outcomes} == {appstats.TaskStatus.OK}
    finally:
        for client in clients:
            client.close()
        service.stop()
