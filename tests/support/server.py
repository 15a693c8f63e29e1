"""Pytest plugin: a small real AppStats handler and in-process servers on port 0.

The handler's behaviour is picked by the request's ``app``:

* ``""`` raises the declared ``InvalidRequest``;
* ``"internal"`` raises a plain ``RuntimeError`` (an undeclared, internal error);
* ``"overloaded"`` raises the declared ``Overloaded`` (``retry_after_ms`` 40);
* ``"unencodable"`` returns a response the IDL cannot encode (a bug of its own);
* ``"slow"`` waits until the test releases it (or ``slow_s`` passes);
* anything else answers :func:`sample_response`.

    def test_something(start_server):
        server = start_server(transport="buffered")
        host, port = server.address
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import gevent.event
import pytest
from thriftpy2.thrift import TProcessor

from service.idl import appstats
from service.listener.server import ThriftServer
from service.overload.pacing import current_connection
from service.settings.server import ServerSettings

__all__ = [
    "COMBINATIONS",
    "SECRET",
    "RecordingHandler",
    "sample_response",
    "handler",
    "start_server",
    "read_until_closed",
]

#: Every transport x protocol pair the server offers.
COMBINATIONS = [
    ("framed", "binary"),
    ("framed", "compact"),
    ("buffered", "binary"),
    ("buffered", "compact"),
]
#: Text in the internal error's message that must never reach a caller.
SECRET = "password is hunter2"


def sample_response(app: str) -> Any:
    """A StatsResponse with one panel of each PanelData member and mixed outcomes."""
    panel = appstats.PanelData
    panels = {
        "errors": panel(
            error_summary=appstats.ErrorSummary(
                total=3, top=[appstats.MessageCount(message="KeyError: 'id'", count=3)]
            )
        ),
        "urls": panel(
            top_list=appstats.TopList(
                entries=[appstats.TopEntry(key="/cart", count=2, mean_ms=1.5, total_ms=3.0)]
            )
        ),
        "latency": panel(
            series=appstats.Series(
                points=[
                    appstats.Point(ts_ms=1_000, value=12.5),
                    appstats.Point(ts_ms=2_000, value=7.25),
                ],
                step_ms=1_000,
            )
        ),
        "alerts": panel(
            alert_list=appstats.AlertList(
                alerts=[
                    appstats.Alert(
                        id="a-1", severity="critical", title="CPU high", triggered_ms=1_500
                    )
                ]
            )
        ),
    }
    outcomes = [
        appstats.TaskOutcome(
            name=name,
            source="mongo",
            status=appstats.TaskStatus.OK,
            elapsed_ms=1.25,
            retryable=False,
        )
        for name in panels
    ]
    outcomes.append(
        appstats.TaskOutcome(
            name="volume",
            source="http",
            status=appstats.TaskStatus.TIMEOUT,
            elapsed_ms=100.0,
            error_type="Timeout",
            message="no answer within 100 ms",
            retryable=True,
        )
    )
    return appstats.StatsResponse(
        app=app, panels=panels, outcomes=outcomes, trace_id="0" * 32, elapsed_ms=4.5
    )


class RecordingHandler:
    """Records every request, and how many calls ran at once."""

    def __init__(self, slow_s: float = 10.0) -> None:
        self.slow_s = slow_s
        self.requests: list[Any] = []
        #: Each call's client identity, as the server saw its connection (fair share).
        self.identities: list[str] = []
        self.active = 0
        self.max_active = 0
        self.entered = gevent.event.Event()  # set when a slow call starts
        self.released = gevent.event.Event()  # set to let slow calls finish

    def ping(self) -> str:
        return "pong"

    def panels(self) -> list[str]:
        return ["alerts", "errors", "latency", "urls"]

    def get_app_stats(self, request: Any) -> Any:
        self.requests.append(request)
        pacing = current_connection.get()
        self.identities.append(pacing.identity if pacing is not None else "")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if request.app == "":
                raise appstats.InvalidRequest(message="app must not be empty", field="app")
            if request.app == "internal":
                raise RuntimeError(f"database {SECRET}")
            if request.app == "overloaded":
                raise appstats.Overloaded(message="shedding load", retry_after_ms=40)
            if request.app == "unencodable":
                return appstats.StatsResponse(app=request.app, panels={"errors": 42})
            if request.app == "slow":
                self.entered.set()
                self.released.wait(timeout=self.slow_s)
            return sample_response(request.app)
        finally:
            self.active -= 1


@pytest.fixture
def handler() -> RecordingHandler:
    return RecordingHandler()


@pytest.fixture
def start_server(handler: RecordingHandler) -> Iterator[Callable[..., ThriftServer]]:
    """Start servers for ``handler`` on 127.0.0.1 port 0; released and stopped after the test.

    Keyword arguments are ``ServerSettings`` fields.
    """
    servers: list[ThriftServer] = []

    def start(**settings: Any) -> ThriftServer:
        options: dict[str, Any] = {"host": "127.0.0.1", "port": 0, **settings}
        server = ThriftServer(TProcessor(appstats.AppStats, handler), ServerSettings(**options))
        server.start()
        servers.append(server)
        return server

    yield start
    handler.released.set()
    for server in servers:
        server.stop(timeout_s=5.0)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes; raises TimeoutError if it never does."""
    received = b""
    for _ in range(1000):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError("server kept sending")
