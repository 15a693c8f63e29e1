"""The Deployment's fanout container (``deploy/kubernetes/deployment.yaml``), run here.

:func:`container_run` turns the container into a command line and environment
as a pod gets them. Only what must differ on one test machine is substituted,
and every substitution is named: the backends' addresses (the Secret's MongoDB
URI, the HTTP services' cluster names) and the OTLP collector point at local
servers, and each container port moves to a free port, since a test machine has
one network namespace where a cluster gives each pod its own. Everything else,
the command, its flags and every other variable, is the manifest's own, so a
flag the command does not take fails the tests that run it.

:func:`check_serving` and :func:`check_drain` are what a kubelet and a caller
see: probes, a scrape, a Thrift call, and SIGTERM's lame duck and drain.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from service.client import AppStatsClient
from service.idl import appstats
from service.samples.mongo_server import free_port
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.sockets import wait_for

__all__ = [
    "MANIFEST",
    "ContainerRun",
    "deployment",
    "fanout_container",
    "container_run",
    "check_serving",
    "check_drain",
    "http_get",
]

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "deployment.yaml"
ALL_PANELS = {"errors", "urls", "controllers", "queries", "alerts", "latency", "volume"}


@dataclass
class ContainerRun:
    """The container as run here: ``command`` (the manifest's ``command`` + ``args``)."""

    entrypoint: list[str]
    args: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # the manifest's port names -> the ports used here
    substituted: set[str] = field(default_factory=set)

    @property
    def command(self) -> list[str]:
        return [*self.entrypoint, *self.args]


def deployment() -> dict[str, Any]:
    return next(
        doc
        for doc in yaml.safe_load_all(MANIFEST.read_text())
        if doc and doc["kind"] == "Deployment"
    )


def fanout_container() -> dict[str, Any]:
    containers = deployment()["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "fanout")


#: A backend table's variable, and the key of the sample backends' overrides it takes.
_BACKEND_KEYS = {
    "FANOUT_BACKENDS_MONGO_URI": "mongo.uri",
    "FANOUT_BACKENDS_MONGO_DATABASE": "mongo.database",
    "FANOUT_BACKENDS_ALERTS_URL": "http.alerts_url",
    "FANOUT_BACKENDS_METRICS_URL": "http.metrics_url",
}


def _setting_key(variable: str) -> str:
    """``FANOUT_SERVER_PORT`` -> ``server.port``; a backend table's address variable -> the
    sample backends' key for it (``FANOUT_BACKENDS_ALERTS_URL`` -> ``http.alerts_url``)."""
    if variable in _BACKEND_KEYS:
        return _BACKEND_KEYS[variable]
    section, _, key = variable.removeprefix("FANOUT_").lower().partition("_")
    return f"{section}.{key}"


def container_run(
    container: Mapping[str, Any], backends: Mapping[str, str], otlp_endpoint: str
) -> ContainerRun:
    """The container with its backends at ``backends`` (settings keys) and free ports."""
    env: dict[str, str] = {}
    substituted: set[str] = set()
    for variable in container.get("env", []):
        name = variable["name"]
        key = _setting_key(name)
        if key in backends:
            env[name] = backends[key]
        elif name == "OTEL_EXPORTER_OTLP_ENDPOINT":
            env[name] = otlp_endpoint
        else:
            assert "value" in variable, (
                f"{name} comes from {variable}: nothing here to take it from"
            )
            env[name] = str(variable["value"])
            continue
        substituted.add(name)
    ports = {}
    for port in container["ports"]:
        holders = [
            name
            for name, value in env.items()
            if name.endswith("_PORT") and value == str(port["containerPort"])
        ]
        assert len(holders) == 1, f"port {port} is set by {holders}, not by one variable"
        ports[port["name"]] = free_port()
        env[holders[0]] = str(ports[port["name"]])
        substituted.add(holders[0])
    return ContainerRun(
        list(container.get("command", [])), list(container.get("args", [])), env, ports, substituted
    )


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error status is an answer, not an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


#: How long a freshly started server may answer with timed-out panels while it warms: a
#: margin a machine twice as slow as a busy one keeps, never a duration asserted.
COLD_PATIENCE_S = 60.0


def _answers(url: str) -> bool:
    try:
        return http_get(url, timeout_s=1.0)[0] == 200
    except OSError:
        return False


def check_serving(
    ports: Mapping[str, int], host: str = "127.0.0.1", ready_timeout_s: float = 60.0
) -> None:
    """Probes answer 200, /metrics is a Prometheus scrape, and a call gathers every panel."""
    probes = f"http://{host}:{ports['probes']}"
    wait_for(lambda: _answers(f"{probes}/readyz"), ready_timeout_s, "/readyz answering 200")
    status, body = http_get(f"{probes}/healthz")
    assert status == 200, body
    status, body = http_get(f"{probes}/readyz")
    assert status == 200 and json.loads(body)["status"] == "ready", body
    with AppStatsClient(host, ports["thrift"], timeout_ms=10_000) as client:
        assert client.ping()
        patience = time.monotonic() + COLD_PATIENCE_S
        while True:
            response = client.get_app_stats(
                "shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=10_000
            )
            short = [o for o in response.outcomes if o.status != appstats.TaskStatus.OK]
            if not short or time.monotonic() > patience:
                break
            # A cold pod's first calls open its MongoDB connections: beside a busy node (two
            # CPU hogs, other tests) a panel may run out of its task timeout then, several
            # calls in a row, and fail no other way.
            assert {o.status for o in short} == {appstats.TaskStatus.TIMEOUT}, short
    assert {o.name for o in response.outcomes if o.status == 0} == ALL_PANELS, response.outcomes
    status, scrape = http_get(f"http://{host}:{ports['metrics']}/metrics")
    assert status == 200 and "rpc_server_call_duration_seconds_count" in scrape, scrape[:2000]


def check_drain(
    ports: Mapping[str, int],
    send_sigterm: Callable[[], object],
    exit_code: Callable[[float], int],
    grace_s: float,
    host: str = "127.0.0.1",
) -> None:
    """After SIGTERM /readyz says 503 (lame duck) and the process exits 0 within ``grace_s``."""
    send_sigterm()
    probes = f"http://{host}:{ports['probes']}/readyz"
    wait_for(lambda: not _answers(probes), 10.0, "/readyz leaving 200 after SIGTERM")
    assert exit_code(grace_s) == 0
