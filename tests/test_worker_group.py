"""Pre-forked workers with probes and Prometheus metrics on: one endpoint of each for the
group, served by the master; reloads that never collide on a port; a taken port is a
start-up error. Real ``fanout serve`` processes, real scrapes, real signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import gevent
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.samples.faults import TcpFaultProxy
from service.samples.mongo_server import free_port
from tests.support.group import (  # noqa: F401 (a fixture)
    all_serving,
    group_env,
    group_ports,
    probe,
    reload_and_wait,
)
from tests.support.sockets import wait_for
from tests.support.workers import (  # noqa: F401 (serve: a fixture)
    ALL_PANELS,
    ENV,
    FANOUT,
    PATIENT_START_S,
    Server,
    serve,
)

# A group starts, reloads (twice in one test) and stops: on a machine whose cores other work
# takes, each may take its whole patience, so the test as a whole may take several.
pytestmark = pytest.mark.timeout(6 * PATIENT_START_S)


def test_two_workers_answer_one_probe_endpoint_and_one_merged_scrape(
    serve: Callable[..., Server], group_ports: dict[str, int]
) -> None:
    server = serve("--workers", "2", env=group_env(group_ports))
    wait_for(lambda: all_serving(group_ports, 2), PATIENT_START_S, "both workers serving")
    ready = probe(group_ports, "/readyz")
    assert ready.status_code == 200 and ready.json() == {
        "status": "ready",
        "workers": {"0": "serving", "1": "serving"},
        "backends": {
            name: {"up": True, "circuit": "closed", "detail": ""}
            for name in ("mongo", "alerts", "metrics")
        },
    }
    for _ in range(8):  # new connections: the kernel spreads them over both workers
        with AppStatsClient(*server.address, timeout_ms=10_000) as client:
            client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)

    scrape = requests.get(f"http://127.0.0.1:{group_ports['metrics']}/metrics", timeout=5).text
    for worker in ("0", "1"):
        assert re.search(rf'^fanout_worker_scraped\{{worker="{worker}"\}} 1\.0$', scrape, re.M), (
            scrape
        )
        assert re.search(rf'^fanout_admission_limit\S*\{{.*worker="{worker}".*\}} ', scrape, re.M)
    calls = [
        float(value)
        for value in re.findall(
            r'^rpc_server_call_duration_seconds_count\{.*rpc_method="AppStats/get_app_stats".*\} (\S+)$',
            scrape,
            re.M,
        )
    ]
    assert sum(calls) == 8, scrape
    assert scrape.count("# TYPE rpc_server_call_duration_seconds histogram") == 1  # one family
    assert server.stop() == 0


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("taken", ["probes", "metrics"])
def test_a_taken_port_fails_the_start_naming_it(
    workers: str, taken: str, group_ports: dict[str, int]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", group_ports[taken]))
        holder.listen(1)
        done = subprocess.run(
            [*FANOUT, "serve", "--port", "0", "--workers", workers],
            env={**ENV, **group_env(group_ports)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"fanout: cannot listen on 127.0.0.1:{group_ports[taken]}" in done.stderr
    assert "Traceback" not in done.stderr and "restarting" not in done.stderr, done.stderr[-3000:]


def test_fanout_pools_describes_every_worker_of_the_group(
    serve: Callable[..., Server], group_ports: dict[str, int]
) -> None:
    server = serve("--workers", "2", env=group_env(group_ports))
    wait_for(lambda: all_serving(group_ports, 2), PATIENT_START_S, "both workers serving")

    def group_report() -> Any:
        with AppStatsClient(*server.address, timeout_ms=5_000) as client:
            client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
            report = client.pool_stats()
        return report.workers and len(report.workers) == 2 and report

    report = wait_for(group_report, 20, "a pool report with both workers")
    assert [worker.worker for worker in report.workers] == ["0", "1"]
    assert report.worker in ("0", "1")
    for name in ("fanout.request", "mongo"):
        group = next(pool for pool in report.pools if pool.name == name)
        each = [
            next(pool for pool in worker.pools if pool.name == name) for worker in report.workers
        ]
        assert group.size == sum(pool.size for pool in each) > 0

    def shown_by_cli() -> subprocess.CompletedProcess[str] | None:
        done = subprocess.run(
            [*FANOUT, "pools", "--port", str(server.address[1])],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done if done.stdout.startswith("group of 2 workers\n") else None  # whichever answers

    shown = wait_for(shown_by_cli, 20, "fanout pools answering for both workers")
    assert re.search(r"^worker=0 mongo size=\d+", shown.stdout, re.M), shown.stdout
    assert re.search(r"^worker=1 admission limit=", shown.stdout, re.M), shown.stdout
    assert server.stop() == 0


def _workers_in(scrape: str) -> set[str]:
    """The workers whose own series a merged scrape carries (it must parse)."""
    return {
        sample.labels["worker"]
        for family in text_string_to_metric_families(scrape)
        if family.name == "fanout_admission_limit"
        for sample in family.samples
    }


def test_one_keep_alive_scrape_and_probe_connection_see_the_whole_group_through_reloads_and_a_kill(
    serve: Callable[..., Server], group_ports: dict[str, int]
) -> None:
    server = serve("--workers", "2", env=group_env(group_ports))
    wait_for(lambda: all_serving(group_ports, 2), PATIENT_START_S, "both workers serving")
    scrapes, readiness = requests.Session(), requests.Session()  # one connection each, kept
    wait_for(
        lambda: (
            _workers_in(
                scrapes.get(f"http://127.0.0.1:{group_ports['metrics']}/metrics", timeout=5).text
            )
            == {"0", "1"}
        ),
        20,
        "a first scrape carrying both workers' series",
    )
    seen: list[set[str]] = []
    ready: list[int] = []

    def poll() -> None:
        while True:
            seen.append(
                _workers_in(
                    scrapes.get(
                        f"http://127.0.0.1:{group_ports['metrics']}/metrics", timeout=5
                    ).text
                )
            )
            ready.append(
                readiness.get(
                    f"http://127.0.0.1:{group_ports['probes']}/readyz", timeout=5
                ).status_code
            )
            gevent.sleep(0.5)

    poller = gevent.spawn(poll)
    try:
        for _ in range(2):
            reload_and_wait(server, group_ports)
        victim = server.workers()[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: victim not in server.workers() and all_serving(group_ports, 2),
            30,
            "the killed worker replaced",
        )
        polls = len(seen)
        wait_for(lambda: len(seen) >= polls + 2, 10, "scrapes after the kill")
        # The group's own series: two workers configured, one exit (a reload's retired
        # workers are not exits).
        text = scrapes.get(f"http://127.0.0.1:{group_ports['metrics']}/metrics", timeout=5).text
        assert re.search(r"^fanout_workers_configured 2\.0$", text, re.M), text[:2000]
        assert re.search(r"^fanout_worker_exits_total 1\.0$", text, re.M), text[:2000]
    finally:
        poller.kill()
    assert poller.exception is None or isinstance(poller.exception, gevent.GreenletExit)
    assert len(seen) >= 4 and all(workers == {"0", "1"} for workers in seen), seen
    assert set(ready) == {200}, ready
    ports = {group_ports["probes"], group_ports["metrics"]}
    for pid in server.workers():  # no worker holds a socket of the master's ports
        assert not [
            c
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.laddr.port in ports or (c.raddr and c.raddr.port in ports)
        ]
    assert server.stop() == 0
    assert "Traceback" not in server.logged()


def _backend_up(ports: dict[str, int], server: Server, name: str) -> dict[str, Any]:
    """What the probes, the merged scrape and health() each say of backend ``name``."""
    said: dict[str, Any] = {"probe": probe(ports, "/healthz").json()["backends"][name]["up"]}
    scrape = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).text
    gauges = re.findall(
        rf'^fanout_backend_up\{{.*fanout_backend="{name}".*\}} (\S+)$', scrape, re.M
    )
    said["metrics"] = bool(gauges) and all(float(value) == 1.0 for value in gauges)
    said["metrics_down"] = len(gauges) == 2 and all(float(value) == 0.0 for value in gauges)
    with AppStatsClient(*server.address, timeout_ms=5_000) as client:
        said["health"] = next((b.up for b in client.health().backends if b.name == name), None)
    return said


def test_a_backend_going_down_with_no_calls_shows_everywhere_and_comes_back(
    serve: Callable[..., Server], group_ports: dict[str, int], mongo_server: Any
) -> None:
    port = free_port()
    target = ("127.0.0.1", mongo_server.port)
    proxy = TcpFaultProxy(target, port=port).start()
    env = {**group_env(group_ports), "FANOUT_MONGO_URI": f"mongodb://127.0.0.1:{port}"}
    server = serve("--workers", "2", env=env)
    try:
        wait_for(lambda: all_serving(group_ports, 2), PATIENT_START_S, "both workers serving")
        wait_for(
            lambda: (
                _backend_up(group_ports, server, "mongo")
                == {"probe": True, "metrics": True, "metrics_down": False, "health": True}
            ),
            15,
            "mongo up in the probes, both workers' gauges and health()",
        )
        proxy.stop()  # the backend goes away; nobody calls get_app_stats
        wait_for(
            lambda: (
                _backend_up(group_ports, server, "mongo")
                == {"probe": False, "metrics": False, "metrics_down": True, "health": False}
            ),
            20,
            "mongo down in the probes, both workers' gauges and health()",
        )
        proxy = TcpFaultProxy(target, port=port).start()
        wait_for(
            lambda: (
                _backend_up(group_ports, server, "mongo")["probe"] is True
                and _backend_up(group_ports, server, "mongo")["metrics"] is True
            ),
            20,
            "mongo up again",
        )
    finally:
        proxy.stop()
    assert server.stop() == 0
