"""Three ``fanout serve`` processes behind one client, one of them killed and restarted,
drained, or hung (SIGSTOP: it still accepts connections, and never answers). Calls
go on, each within its deadline, and none fails."""

from __future__ import annotations

import signal
from collections.abc import Callable

import gevent
import pytest

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleHttpServices
from tests.support.processes import Server
from tests.support.sockets import wait_for

pytestmark = pytest.mark.solo  # make test runs it alone: tests/parallel.py

PANELS = ["alerts", "latency", "errors"]
DEADLINE_MS = 1500
CALLERS = 16


class Load:
    """``CALLERS`` greenlets calling back to back until :meth:`stop`; every failure kept."""

    def __init__(self, client: AppStatsClient) -> None:
        self.client = client
        self.made = 0
        self.failures: list[BaseException] = []
        self._callers = [gevent.spawn(self._call) for _ in range(CALLERS)]

    def _call(self) -> None:
        while True:
            try:
                self.client.get_app_stats(
                    "shop", SAMPLE_START_MS, SAMPLE_END_MS, PANELS, deadline_ms=DEADLINE_MS
                )
                self.made += 1
            except Exception as failure:
                self.failures.append(failure)

    def calls_after(self, count: int, timeout_s: float = 30) -> None:
        target = self.made + count
        wait_for(lambda: self.made >= target, timeout_s, f"{count} more calls")

    def stop(self) -> None:
        gevent.killall(self._callers)


@pytest.fixture
def three(serve: Callable[..., Server], http_services: SampleHttpServices) -> list[Server]:
    return [serve(http_services) for _ in range(3)]


def client_of(servers: list[Server]) -> AppStatsClient:
    return AppStatsClient(
        "127.0.0.1",
        servers[0].port,
        pool_size=CALLERS,
        eject_ms=300,
        addresses=[("127.0.0.1", s.port) for s in servers],
    )


def test_a_hung_instance_costs_no_call(three: list[Server]) -> None:
    hung = three[2]
    with client_of(three) as client:
        load = Load(client)
        try:
            load.calls_after(300)  # enough answers for the client to know the tail
            hung.signal(signal.SIGSTOP)
            load.calls_after(600)  # several ejections and returns at 300 ms each
        finally:
            hung.signal(signal.SIGCONT)
            load.stop()
        stuck = next(i for i in client.instances.all if i.port == hung.port)
        assert load.failures == [], (len(load.failures), load.failures[:3], client.backups.budget)
        assert client.backups.sent > 0 and client.backups.won > 0
        assert stuck.failures >= 1  # ejected for answering too slowly, over and over


def test_kill_restart_and_drain_cost_no_call(
    three: list[Server], serve: Callable[..., Server], http_services: SampleHttpServices
) -> None:
    with client_of(three) as client:
        load = Load(client)
        try:
            load.calls_after(200)
            three[1].kill()  # SIGKILL
            load.calls_after(300)
            revived = serve(http_services, port=three[1].port)  # rejoins on the same port
            back = next(i for i in client.instances.all if i.port == revived.port)
            calls_before = back.calls
            wait_for(lambda: back.calls > calls_before + 20, 40, "the restarted instance in use")
            three[0].signal(signal.SIGTERM)  # drain
            load.calls_after(300)
        finally:
            load.stop()
        assert load.failures == [], (len(load.failures), load.failures[:3])
        assert three[0].wait(timeout_s=30) == 0
