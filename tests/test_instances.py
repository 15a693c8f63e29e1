"""Many instances behind one client: balancing, ejecting a dead instance, taking it back."""

from __future__ import annotations

import time
from typing import Any

import gevent

from service.client import AppStatsClient
from service.client.instances import MAX_EJECT_S
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleHttpServices
from tests.support.sockets import wait_for

PANELS = ["alerts", "latency"]


def load(client: AppStatsClient, callers: int, seconds: float) -> tuple[int, list[BaseException]]:
    """``callers`` greenlets calling back to back for ``seconds``: calls made, failures."""
    failures: list[BaseException] = []
    made = [0]
    ends = time.monotonic() + seconds

    def caller() -> None:
        while time.monotonic() < ends:
            try:
                client.get_app_stats(
                    "shop", SAMPLE_START_MS, SAMPLE_END_MS, PANELS, deadline_ms=3000
                )
                made[0] += 1
            except Exception as failure:  # collected and asserted on
                failures.append(failure)

    gevent.joinall([gevent.spawn(caller) for _ in range(callers)], timeout=seconds + 10)
    return made[0], failures


def test_three_instances_one_killed_mid_load_then_back(
    serve: Any, http_services: SampleHttpServices
) -> None:
    servers = [serve(http_services) for _ in range(3)]
    addresses = [("127.0.0.1", s.port) for s in servers]
    with AppStatsClient(
        "127.0.0.1", servers[0].port, addresses=addresses, eject_ms=300, pool_size=8
    ) as client:
        made, failures = load(client, 8, 1.0)
        assert failures == [] and made > 0
        assert all(i.calls > 0 for i in client.instances.all)  # all three got calls

        doomed = servers[1]
        killer = gevent.spawn_later(0.5, doomed.process.kill)
        made, failures = load(client, 8, 2.0)
        killer.join()
        assert failures == [], failures[:3]  # zero failed calls
        dead = next(i for i in client.instances.all if i.port == doomed.port)
        assert dead.failures >= 1

        revived = serve(http_services, port=doomed.port)
        before = dead.calls
        # Back once its ejection ends: doubling from 300 ms while the restart is slow (a
        # loaded machine saw 10 s pass), never past the client's ceiling.
        wait_for(
            lambda: load(client, 4, 0.5)[1] == [] and dead.calls > before,
            MAX_EJECT_S + 5,
            "the revived instance gets calls again",
        )
    assert revived.port == doomed.port


def test_a_name_is_resolved_to_every_address(start_server: Any) -> None:
    server = start_server()
    port = server.address[1]
    with AppStatsClient("localhost", port, resolve=True, eject_ms=1000) as client:
        assert ("127.0.0.1", port) in [i.address for i in client.instances.all]
        assert all(client.ping() == "pong" for _ in range(10))  # an address not served is ejected


def test_power_of_two_choices_prefers_the_less_busy_instance(start_server: Any) -> None:
    servers = [start_server(), start_server()]
    with AppStatsClient(*servers[0].address, addresses=[s.address for s in servers]) as client:
        busy, idle = client.instances.all
        busy.inflight = 5
        assert {client.instances.pick() for _ in range(20)} == {idle}


def test_ejections_run_on_the_clients_clock() -> None:
    """An ejection lasts ``eject_ms`` of the client's clock, then twice as long, whatever
    the wall clock does: a client given a FakeClock is moved by its test."""
    from service.client.connections import ConnectionPool
    from service.client.instances import Instances
    from service.testing import FakeClock

    clock = FakeClock()

    def no_connection(deadline: Any) -> Any:
        raise AssertionError("no call is made here")

    instances = Instances(
        [("127.0.0.1", 1), ("127.0.0.1", 2)],
        lambda host, port: ConnectionPool(no_connection, 1, 1.0, clock),
        eject_s=5.0,
        clock=clock,
    )
    first = instances.all[0]
    instances.eject(first)
    assert first.ejected_until == clock.monotonic() + 5.0
    clock.advance(5.0)
    instances.eject(first)
    assert first.ejected_until == clock.monotonic() + 10.0
