"""A two-worker ``fanout serve`` group with probes and metrics on: its ports, its probes, a
reload that waits for the new generation.

from tests.support.group import group_ports, group_env, all_serving  # group_ports: a fixture
"""

from __future__ import annotations

import signal

import pytest
import requests

from service.samples.mongo_server import free_port
from tests.support.sockets import wait_for
from tests.support.workers import PATIENT_START_S, Server

__all__ = ["group_ports", "group_env", "probe", "scrape", "all_serving", "reload_and_wait"]


@pytest.fixture
def group_ports() -> dict[str, int]:
    return {"probes": free_port(), "metrics": free_port()}


def group_env(ports: dict[str, int]) -> dict[str, str]:
    return {
        "FANOUT_SERVER_PROBE_PORT": str(ports["probes"]),
        "FANOUT_METRICS_EXPORTER": "prometheus",
        "FANOUT_METRICS_PORT": str(ports["metrics"]),
    }


def probe(ports: dict[str, int], path: str) -> requests.Response:
    return requests.get(f"http://127.0.0.1:{ports['probes']}{path}", timeout=5)


def scrape(ports: dict[str, int]) -> str:
    """The group's merged scrape."""
    return requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5).text


def all_serving(ports: dict[str, int], count: int) -> bool:
    try:
        workers = probe(ports, "/healthz").json()["workers"]
    except requests.RequestException:
        return False
    return len(workers) == count and set(workers.values()) == {"serving"}


def reload_and_wait(server: Server, ports: dict[str, int]) -> None:
    """SIGHUP, then wait until two new workers serve and the old ones are gone."""
    before = set(server.workers())
    server.process.send_signal(signal.SIGHUP)
    # Two workers start and two drain: twice a start's patience.
    wait_for(
        lambda: not before & set(server.workers()) and all_serving(ports, 2),
        2 * PATIENT_START_S,
        "two new workers serving, the old ones gone",
    )
