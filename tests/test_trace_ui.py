"""Fanout's traces in a real Zipkin server (Java 17, the jar from Maven Central), read back
through Zipkin's own API: what its UI shows is what these assert."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from service.cli.trace_ui import TraceUiRun
from service.samples.zipkin_server import ZipkinServer
from tests.support.toolchains import needs
from tracing.zipkin import remote_endpoint

pytestmark = needs("zipkin")


@pytest.fixture(scope="module")
def zipkin() -> Iterator[ZipkinServer]:
    with ZipkinServer() as server:
        yield server


@pytest.fixture(scope="module")
def run(zipkin: ZipkinServer) -> TraceUiRun:
    """``fanout trace-ui`` as a user runs it, against the module's Zipkin."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "trace-ui", "--zipkin", zipkin.url, "--exit"],
        # Budgets a stressed run keeps: the whole trace is asserted free of errors, and
        # with the defaults one saw a task cut. The cut call's own budgets are its.
        env={
            **os.environ,
            "FANOUT_FANOUT_TASK_TIMEOUT_MS": "8000",
            "FANOUT_FANOUT_REQUEST_DEADLINE_MS": "10000",
            "FANOUT_HTTP_READ_TIMEOUT_MS": "8000",
        },
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    whole, cut = re.findall(r"/zipkin/traces/([0-9a-f]{32})", done.stdout)
    assert "/zipkin/dependency?startTime=" in done.stdout
    return TraceUiRun(whole, cut, zipkin.url)


def api(zipkin: ZipkinServer, path: str) -> Any:
    with urllib.request.urlopen(f"{zipkin.url}/api/v2/{path}", timeout=10) as answer:
        return json.loads(answer.read())


def test_the_dependency_graph_names_every_downstream_service(
    zipkin: ZipkinServer, run: TraceUiRun
) -> None:
    assert set(api(zipkin, "remoteServices?serviceName=fanout")) >= {"mongodb", "alerts", "metrics"}
    end_ms = int(time.time() * 1000) + 60_000
    links = {
        (link["parent"], link["child"])
        for link in api(zipkin, f"dependencies?endTs={end_ms}&lookback=3600000")
    }
    assert links >= {
        ("web-tier", "fanout"),
        ("fanout", "mongodb"),
        ("fanout", "alerts"),
        ("fanout", "metrics"),
    }


def test_client_spans_read_apart_in_zipkin(zipkin: ZipkinServer, run: TraceUiRun) -> None:
    spans = api(zipkin, f"trace/{run.whole_trace_id}")
    clients = sorted(
        span["name"]
        for span in spans
        if span.get("kind") == "CLIENT" and span["localEndpoint"]["serviceName"] == "fanout"
    )
    assert clients == [
        "aggregate errors",
        "aggregate queries",
        "aggregate requests",
        "aggregate requests",
        "get /apps/{app}/alerts",
        "get /apps/{app}/series/latency",
        "get /apps/{app}/series/volume",
    ]
    tasks = [span for span in spans if span["name"].startswith("fanout.task")]
    assert len(tasks) == 7 and all("error" not in span.get("tags", {}) for span in tasks)
    wait_ms = [span["tags"]["fanout.pool.wait_ms"] for span in tasks]
    assert all(len(value.split(".")[-1]) <= 2 for value in wait_ms), wait_ms


def test_a_task_cut_at_the_deadline_is_red_and_ends_within_the_call(
    zipkin: ZipkinServer, run: TraceUiRun
) -> None:
    spans = api(zipkin, f"trace/{run.cut_trace_id}")
    (server,) = [s for s in spans if s.get("kind") == "SERVER"]
    (alerts,) = [s for s in spans if s["name"] == "fanout.task alerts"]
    assert alerts["tags"]["fanout.task.status"] == "TIMEOUT"
    assert "error" in alerts["tags"]  # Zipkin's red
    assert alerts["timestamp"] + alerts["duration"] <= server["timestamp"] + server["duration"]
    others = [s for s in spans if s["name"].startswith("fanout.task") and s is not alerts]
    assert len(others) == 6 and all(s["tags"]["fanout.task.status"] == "OK" for s in others)


def test_remote_endpoint_from_client_span_attributes() -> None:
    assert remote_endpoint(
        {"peer.service": "MongoDB", "server.address": "127.0.0.1", "server.port": 27017}
    ) == {"serviceName": "mongodb", "ipv4": "127.0.0.1", "port": 27017}
    assert remote_endpoint(
        {
            "peer.service": "alerts",
            "server.address": "alerts.internal",
            "network.peer.address": "::1",
            "server.port": 8080,
        }
    ) == {"serviceName": "alerts", "ipv6": "::1", "port": 8080}
    assert remote_endpoint({"server.address": "db.internal", "server.port": 0}) is None
