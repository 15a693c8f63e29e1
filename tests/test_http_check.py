"""An HTTP backend's health check on a kept connection, against real local servers:
what it sends, when it reuses its connection, and a service that closed it meanwhile."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gevent.server import StreamServer

from lookups.backends.http_check import KEPT_BODY_BYTES, HttpCheck
from lookups.backends.tls import HttpsFiles
from service.samples.http_services import serve_wsgi


class Seen:
    """A WSGI app answering ``status`` with ``body``; what each request came with."""

    def __init__(self, status: str = "200 OK", body: bytes = b"ok") -> None:
        self.status, self.body = status, body
        self.requests: list[dict[str, str]] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        self.requests.append(
            {
                "client_port": environ["REMOTE_PORT"],
                "target": environ.get("RAW_URI", ""),
                "authorization": environ.get("HTTP_AUTHORIZATION", ""),
            }
        )
        start_response(self.status, [("Content-Length", str(len(self.body)))])
        return [self.body]


class Servers:
    """Real local HTTP servers, stopped after the test."""

    def __init__(self) -> None:
        self.running: list[Any] = []

    def serve(self, app: Seen, port: int = 0) -> int:
        server = serve_wsgi(app, port=port)
        self.running.append(server)
        return int(server.server_port)

    def stop(self) -> None:
        """Stop every server: their connections close with them."""
        for server in self.running:
            server.stop(timeout=1)
        self.running.clear()


@pytest.fixture
def servers() -> Iterator[Servers]:
    running = Servers()
    yield running
    running.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_checks_reuse_one_connection_and_send_the_configured_request(servers: Servers) -> None:
    app = Seen()
    port = servers.serve(app)
    check = HttpCheck(f"http://127.0.0.1:{port}/health?deep=1", HttpsFiles(), "Bearer t0k")
    try:
        assert [check.status(2.0) for _ in range(5)] == [200] * 5
    finally:
        check.close()
    assert len({seen["client_port"] for seen in app.requests}) == 1
    assert {seen["target"] for seen in app.requests} == {"/health?deep=1"}
    assert {seen["authorization"] for seen in app.requests} == {"Bearer t0k"}


def test_a_connection_the_service_closed_meanwhile_is_opened_again_in_the_check() -> None:
    accepted = []

    def answer_once(connection: socket.socket, address: Any) -> None:
        """Answer one request as if keeping the connection, then close it (as a keep-alive
        timeout would)."""
        accepted.append(address)
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        connection.close()

    server = StreamServer(("127.0.0.1", 0), answer_once)
    server.start()
    check = HttpCheck(f"http://127.0.0.1:{server.server_port}/", HttpsFiles())
    try:
        assert [check.status(2.0) for _ in range(3)] == [200] * 3
    finally:
        check.close()
        server.stop()
    assert len(accepted) == 3


def test_a_long_body_is_left_unread_and_its_connection_closed(servers: Servers) -> None:
    app = Seen(body=b"x" * (KEPT_BODY_BYTES + 1))
    port = servers.serve(app)
    check = HttpCheck(f"http://127.0.0.1:{port}/", HttpsFiles())
    try:
        assert [check.status(2.0) for _ in range(3)] == [200] * 3
    finally:
        check.close()
    assert len({seen["client_port"] for seen in app.requests}) == 3


def test_a_redirect_is_an_answer_not_followed_and_no_service_raises(servers: Servers) -> None:
    app = Seen(status="302 Found", body=b"")
    port = servers.serve(app)
    check = HttpCheck(f"http://127.0.0.1:{port}/", HttpsFiles())
    assert check.status(2.0) == 302 and len(app.requests) == 1
    check.close()
    nothing = HttpCheck(f"http://127.0.0.1:{_free_port()}/", HttpsFiles())
    with pytest.raises(ConnectionRefusedError):
        nothing.status(2.0)
