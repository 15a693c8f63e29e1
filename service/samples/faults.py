"""Fault-injecting real servers, for the fault tests, the soak run and benchmarks.

Both listen on real sockets of 127.0.0.1 (port 0 unless told otherwise) and run on gevent
in the calling process. Modes can be switched while they run.

``FaultyHttpService``: the sample alerts *and* metrics API on one gevent WSGI server
(use :attr:`~FaultyHttpService.url` as both ``http.alerts_url`` and ``http.metrics_url``)::

    ok        answer as the sample services do (service.samples.http_services)
    slow      wait ``delay_ms``, then answer as in ``ok``
    error500  HTTP 500 with a JSON error body
    flaky503  every fourth request (the 1st, 5th, ...) HTTP 503; the others as in ``ok``
    bad_json  HTTP 200, ``application/json``, with a body that is not JSON
    hang      read the request and never answer (until the mode changes or the server stops)
    reset     read the request, then reset the connection (TCP RST); with ``partial=True``
              first send the status line, headers and part of the body

    refuse() / resume()   stop listening, dropping live connections (connects are refused);
                          listen again on the same port

With ``auth_token`` set, a request without ``Authorization: Bearer <auth_token>`` gets 401.

``TcpFaultProxy``: a TCP proxy in front of a real server (e.g. nx-27017)::

    set_delay_ms(n)   hold every chunk sent towards the server n ms before forwarding it
    reset_all()       reset (RST) every live connection, both sides
    pause()/resume()  stop forwarding bytes either way / forward what was held (a held
                      request whose client has gone meanwhile is dropped)
    set_target(addr)  send new connections to another server (e.g. a restarted one)
    garble_next_reply(marker)
                      give the next reply holding ``marker`` a wrong MongoDB responseTo
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import gevent
from gevent.event import Event
from gevent.pool import Pool
from gevent.pywsgi import WSGIServer

from service.samples.fault_proxy import TcpFaultProxy, reset_socket
from service.samples.http_services import (
    AlertsService,
    MetricsService,
    RawPathHandler,
    path_segments,
)
from service.samples.seed import SampleData

__all__ = ["HTTP_MODES", "FaultyHttpService", "TcpFaultProxy", "reset_socket"]

HTTP_MODES = ("ok", "slow", "error500", "flaky503", "bad_json", "hang", "reset")
_HANG_LIMIT_S = 120.0  # a hung request ends by itself after this, whatever happens
#: How long a stop lets requests in flight finish before their handlers are killed. Short: a
#: client's idle keep-alive connection holds its handler until then, so every stop of a
#: server a pooled client had used waited the whole grace.
_STOP_GRACE_S = 0.05
_BAD_JSON = b'{"alerts": [{"id": "a-1", "severity": '
_PARTIAL_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n" + _BAD_JSON
)


class _FaultHandler(RawPathHandler):
    """Applies the connection-level modes (hang, reset) once a request has been read."""

    def handle_one_response(self) -> None:
        faults: FaultyHttpService = self.server.faults
        mode = faults.mode
        if mode == "hang":
            faults.wait_for_release()
            self.close_connection = True
        elif mode == "reset":
            if faults.partial:
                self.socket.sendall(_PARTIAL_HEAD)
            self.rfile.close()  # the socket's file keeps the descriptor open otherwise
            reset_socket(self.socket)
            self.close_connection = True
        else:
            super().handle_one_response()


class FaultyHttpService:
    """The sample alerts and metrics API with switchable faults; a context manager.

    :meth:`set_mode` raises :class:`ValueError` for a mode not in ``HTTP_MODES``.
    :meth:`start` and :meth:`resume` raise :class:`OSError` when the port cannot be bound.
    """

    def __init__(
        self, data: SampleData, *, host: str = "127.0.0.1", port: int = 0, auth_token: str = ""
    ) -> None:
        self.host = host
        self._port = port
        self._alerts = AlertsService(data)
        self._metrics = MetricsService(data)
        self._auth_token = auth_token
        self.mode = "ok"
        self.delay_ms = 0
        self.partial = False
        self.requests_seen = 0
        self._release = Event()
        self._pool = Pool()
        self._server: WSGIServer | None = None

    @property
    def url(self) -> str:
        """``http://host:port``; the same port after :meth:`refuse` and :meth:`resume`."""
        if not self._port:
            raise RuntimeError("the service was never started")
        return f"http://{self.host}:{self._port}"

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def greenlets(self) -> frozenset[gevent.Greenlet]:
        """The greenlets serving connections now (so tests can tell them from the caller's)."""
        return frozenset(self._pool.greenlets)

    def set_mode(self, mode: str, *, delay_ms: int = 0, partial: bool = False) -> None:
        """Switch to ``mode`` for requests read from now on; ends requests held by ``hang``."""
        if mode not in HTTP_MODES:
            raise ValueError(f"mode must be one of {', '.join(HTTP_MODES)}, got {mode!r}")
        self.mode, self.delay_ms, self.partial = mode, delay_ms, partial
        self._release.set()
        self._release = Event()

    def wait_for_release(self) -> None:
        """Block the calling handler until the mode changes, the server stops, or a long limit."""
        self._release.wait(timeout=_HANG_LIMIT_S)

    def start(self) -> FaultyHttpService:
        """Listen (idempotent); connections are accepted once this returns."""
        if self._server is None:
            self._pool = Pool()
            server = WSGIServer(
                (self.host, self._port),
                self._app,
                log=None,
                handler_class=_FaultHandler,
                spawn=self._pool,
            )
            server.faults = self
            server.start()
            self._server, self._port = server, server.server_port
        return self

    def refuse(self) -> None:
        """Close the listener and every live connection: new connections are refused."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(timeout=_STOP_GRACE_S)

    def resume(self) -> None:
        """Listen again, on the same port."""
        self.start()

    def stop(self) -> None:
        """Stop listening and end every connection; idempotent."""
        self._release.set()
        self.refuse()

    def __enter__(self) -> FaultyHttpService:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        self.requests_seen += 1
        if self._auth_token and environ.get("HTTP_AUTHORIZATION") != f"Bearer {self._auth_token}":
            return _respond(
                start_response, "401 Unauthorized", b'{"error": "bearer token required"}'
            )
        mode = self.mode
        if mode == "slow" and self.delay_ms > 0:
            gevent.sleep(self.delay_ms / 1000)
        if mode == "error500":
            return _respond(
                start_response, "500 Internal Server Error", b'{"error": "injected fault"}'
            )
        if mode == "flaky503" and self.requests_seen % 4 == 1:
            return _respond(start_response, "503 Service Unavailable", b'{"error": "try again"}')
        if mode == "bad_json":
            return _respond(start_response, "200 OK", _BAD_JSON)
        segments = path_segments(environ)
        sample = self._alerts if segments[2:3] == ["alerts"] else self._metrics
        return sample(environ, start_response)


def _respond(start_response: Callable[..., Any], status: str, body: bytes) -> list[bytes]:
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    )
    return [body]
