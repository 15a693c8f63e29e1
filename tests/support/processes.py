"""Pytest plugin: ``fanout serve`` as a real process over the sample backends.

    def test_something(serve, http_services):
        server = serve(http_services, **{"server.drain_timeout_ms": 1000})
        ...server.port, server.signal(signal.SIGTERM), server.log()...

Settings reach the process as ``FANOUT_*`` variables; its log (INFO) goes to a file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest

from service.samples import SampleHttpServices
from tests.support.samples import GENEROUS_BUDGETS, backend_overrides
from tests.support.workers import PATIENT_START_S

__all__ = ["FANOUT", "Server", "server_environment", "serve"]

#: The ``fanout`` command, run from this checkout.
FANOUT = [sys.executable, "-m", "service.cli"]


class Server:
    """A ``fanout serve`` process; its log (stderr) goes to a file."""

    def __init__(
        self, env: dict[str, str], log_path: Path, port: int = 0, args: tuple[str, ...] = ()
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [*FANOUT, "--log-level", "info", "serve", "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        try:
            with gevent.Timeout(PATIENT_START_S, AssertionError("server did not start")):
                assert self.process.stdout is not None
                line = self.process.stdout.readline()
            found = re.search(r"serving on [^\s\"]+:(\d+)", line)  # plain, or a JSON line
            assert found, line + self.log()
            self.first_line = line
            self.port = int(found.group(1))
        except BaseException:
            self.kill()  # never left running when the test could not even start it
            raise

    def signal(self, signum: int) -> float:
        """Send ``signum``; return the monotonic time just before it was sent.

        Read before, not after: on a busy machine this process may be descheduled
        between the two, while the server already acts on the signal.
        """
        sent = time.monotonic()
        self.process.send_signal(signum)
        return sent

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


def server_environment(
    mongo: Any, http: SampleHttpServices, env: Any = None, **settings: Any
) -> dict[str, str]:
    """The environment of a ``fanout serve`` over ``mongo`` and ``http``: this process's,
    with ``env`` and ``settings`` (dotted keys) as ``FANOUT_*`` variables, generous
    timeouts and no span export."""
    keys = {**backend_overrides(mongo, http), **GENEROUS_BUDGETS, **settings}
    # Not what this test process chose for itself: the server must choose as a user's would.
    inherited = {k: v for k, v in os.environ.items() if k != "OTEL_SEMCONV_STABILITY_OPT_IN"}
    return {
        **inherited,
        "OTEL_TRACES_EXPORTER": "none",
        **(env or {}),
        **{"FANOUT_" + key.replace(".", "_").upper(): str(value) for key, value in keys.items()},
    }


@pytest.fixture
def serve(mongo_server: Any, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start ``fanout serve`` processes; ``serve(http, **settings)``; killed after the test.

    ``env`` adds environment variables, ``args`` arguments after ``serve``.
    """
    started: list[Server] = []

    def start(
        http: SampleHttpServices,
        env: Any = None,
        port: int = 0,
        args: tuple[str, ...] = (),
        **settings: Any,
    ) -> Server:
        server = Server(
            server_environment(mongo_server, http, env, **settings),
            tmp_path / f"server-{len(started)}.log",
            port,
            args,
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()
