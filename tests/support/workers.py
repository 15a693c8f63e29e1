"""``fanout serve`` as a process, for the tests of pre-forked workers.

from tests.support.workers import serve  # the fixture

def test_something(serve):
    server = serve("--workers", "2", env={"FANOUT_SERVER_PROBE_PORT": "8086"})
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import psutil
import pytest

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleHttpServices
from tests.support.samples import backend_overrides
from tests.support.sockets import wait_for

__all__ = [
    "FANOUT",
    "ENV",
    "PATIENT_START_S",
    "ALL_PANELS",
    "Server",
    "serve",
    "gather_all_panels",
    "set_server_keys",
    "worker_connections",
]

FANOUT = [sys.executable, "-m", "service.cli"]
#: How long a ``fanout serve`` may take to print its address, and a group to replace its
#: workers, before a test gives up: far past what a quiet machine needs (imports and all),
#: so that one whose cores other work takes (``make test-stress``) still passes. A test
#: that passes never waits it out.
PATIENT_START_S = 60
ENV = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
ALL_PANELS = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]


class Server:
    """A ``fanout serve`` process: its address, its workers, and a way to stop it."""

    def __init__(self, process: subprocess.Popen[Any]) -> None:
        self.process = process
        # What the group logs is read as it is written: a pipe left unread fills (64 KiB)
        # and then stops every process of the group at its next log line. A loaded
        # machine logs more (blocked loops, late workers): a reload once hung on it.
        self._logged: list[str] = []
        self._reader = gevent.spawn(self._read_log)
        assert process.stdout is not None and process.stderr is not None
        try:
            with gevent.Timeout(PATIENT_START_S):
                self.line = process.stdout.readline().strip()
        except gevent.Timeout:
            raise AssertionError(
                f"fanout serve did not print its address within {PATIENT_START_S} s; "
                f"its log:\n{self.logged()[-3000:]}"
            ) from None
        found = re.search(r"serving on (\S+):(\d+)", self.line)
        if found is None:  # it ended before serving: its log says why
            process.wait(timeout=10)
            self._reader.join(timeout=5)
        assert found, (
            f"first line {self.line!r}, exit {process.poll()}; log:\n{self.logged()[-3000:]}"
        )
        self.address = (found.group(1), int(found.group(2)))

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._logged.append(line)

    def logged(self) -> str:
        """What the server has written to stderr (all of it, once it has exited)."""
        if self.process.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._logged)

    def workers(self) -> list[int]:
        return sorted(child.pid for child in psutil.Process(self.process.pid).children())

    def stop(self, timeout_s: float = 30) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


@pytest.fixture
def serve(
    tmp_path: Path, mongo_server: Any, http_services: SampleHttpServices
) -> Iterator[Callable[..., Server]]:
    """Start ``fanout serve --port 0 ARGS`` over the session's backends; killed after the test."""
    started: list[Server] = []
    config = tmp_path / "fanout.toml"
    overrides = backend_overrides(mongo_server, http_services)
    config.write_text(
        "\n".join(
            [
                "[server]",
                "drain_timeout_ms = 3000",
                "[mongo]",
                f'uri = "{overrides["mongo.uri"]}"',
                f'database = "{overrides["mongo.database"]}"',
                "[http]",
                f'alerts_url = "{overrides["http.alerts_url"]}"',
                f'metrics_url = "{overrides["http.metrics_url"]}"',
                "",
            ]
        )
    )

    def start(*args: str, env: dict[str, str] | None = None) -> Server:
        process = subprocess.Popen(
            [*FANOUT, "serve", "--config", str(config), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**ENV, **(env or {})},
        )
        try:
            server = Server(process)
        except BaseException:
            process.kill()
            raise
        started.append(server)
        return server

    yield start
    for server in started:
        pids = server.workers() if server.process.poll() is None else []
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def gather_all_panels(address: tuple[str, int], within_s: float = 30.0) -> None:
    """A call to ``address`` answers every panel OK within ``within_s``.

    Asked again until then: on a busy machine a panel may run out of its default budget
    once (the embedded MongoDB-wire server serves one query at a time), which says nothing
    of the workers under test. The last answer is the one a failure shows.
    """
    every_ok = {name: 0 for name in ALL_PANELS}
    seen: list[dict[str, int]] = []

    def answered_all() -> bool:
        with AppStatsClient(*address, timeout_ms=10_000) as client:
            response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
        seen.append({o.name: o.status for o in response.outcomes})
        return seen[-1] == every_ok

    try:
        wait_for(answered_all, within_s, "every panel OK", poll_s=0.2)
    except AssertionError:
        assert seen[-1] == every_ok  # names the panels that were not
        raise


def set_server_keys(config: Path, **keys: Any) -> None:
    """Rewrite ``config``'s [server] table with ``keys`` set (the file the server reloads)."""
    kept = [
        line for line in config.read_text().splitlines() if line.split(" = ")[0] not in keys
    ]  # a key set again replaces the old line
    lines = [f"{key} = {value}" for key, value in keys.items()]
    at = kept.index("[server]") + 1
    config.write_text("\n".join(kept[:at] + lines + kept[at:]) + "\n")


def worker_connections(server: Server) -> dict[int, int]:
    """Established connections on the server's port, by worker pid."""
    port = server.address[1]
    counts = {}
    for pid in server.workers():
        try:
            counts[pid] = sum(
                1
                for c in psutil.Process(pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
            )
        except psutil.NoSuchProcess:
            continue
    return counts
