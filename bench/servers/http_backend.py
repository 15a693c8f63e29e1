"""The benchmark's HTTP backends: the sample alerts and metrics answers, served lean, after a delay.

The answers are exactly those of :class:`service.samples.SampleHttpServices` (the same
WSGI apps compute them), but each distinct request target is computed once and cached,
and requests are parsed by a minimal HTTP/1.1 keep-alive loop on a gevent
``StreamServer`` instead of ``pywsgi``. The sample metrics service buckets a day of
samples in Python on every call (about a millisecond of CPU), and ``pywsgi`` costs a
few hundred microseconds more; at thousands of requests a second that would compete
with the service under test for the machine's cores.

What is served: ``GET`` with the request target as sent (path and query), HTTP/1.1
keep-alive (HTTP/1.0 and ``Connection: close`` close after the answer), request bodies
skipped by ``Content-Length``. Every request is answered ``delay_ms`` after its head
arrived (``gevent.sleep``: no CPU). With ``--fail-every N``, every Nth ``GET`` of each
service is answered ``200`` with a body cut short (not JSON): a panel that fails, and that
no retry mends.

    python -m bench.servers.http_backend --delay-ms 20 [--fail-every 60]

prints ``READY {"alerts_url": ..., "metrics_url": ...}`` and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

import gevent
from gevent.server import StreamServer

from bench.servers.ready import announce_ready, wait_for_stop_signal
from service.samples.http_services import AlertsService, MetricsService
from service.samples.seed import DEFAULT_SEED, generate_sample_data

__all__ = ["LeanHttpServer", "BenchHttpBackends", "main"]

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
MAX_HEAD_BYTES = 16 * 1024
_CACHE_LIMIT = 4096
_RECV_BYTES = 64 * 1024
_CUT_SHORT = b'{"alerts": [{"id": "a-1", "severity": '


class _BadRequest(Exception):
    pass


class LeanHttpServer:
    """Serves one WSGI app's ``GET`` answers, cached per request target; ``with`` or start/stop."""

    def __init__(
        self,
        app: WsgiApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_ms: float = 0,
        fail_every: int = 0,
    ) -> None:
        self._app = app
        self._delay_s = max(0.0, delay_ms / 1000.0)
        self._fail_every = max(0, fail_every)
        self._server = StreamServer((host, port), self._serve_connection)
        self._answers: dict[bytes, bytes] = {}
        self.requests = 0

    @property
    def url(self) -> str:
        host, port = self._server.address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LeanHttpServer:
        """Bind and accept in the background. Raises ``OSError`` if the address is taken."""
        self._server.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        self._server.stop(timeout=timeout_s)

    def _serve_connection(self, sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffered = b""
        try:
            while True:
                head, buffered = _read_head(sock, buffered)
                if head is None:
                    return
                method, target, keep_alive, body_bytes = _parse_head(head)
                buffered = _skip_body(sock, buffered, body_bytes)
                self.requests += 1
                if self._delay_s > 0:
                    gevent.sleep(self._delay_s)
                sock.sendall(self._response(method, target, keep_alive))
                if not keep_alive:
                    return
        except _BadRequest as exc:
            sock.sendall(_http_response("400 Bad Request", str(exc).encode(), keep_alive=False))
        except OSError as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        finally:
            sock.close()

    def _response(self, method: bytes, target: bytes, keep_alive: bool) -> bytes:
        if method != b"GET" or not keep_alive:
            return _http_response(*self._call_app(method, target), keep_alive=keep_alive)
        if self._fail_every and self.requests % self._fail_every == 0:
            return _http_response("200 OK", _CUT_SHORT, keep_alive=True)
        answer = self._answers.get(target)
        if answer is None:
            answer = _http_response(*self._call_app(method, target), keep_alive=True)
            if len(self._answers) >= _CACHE_LIMIT:
                self._answers.clear()
            self._answers[target] = answer
        return answer

    def _call_app(self, method: bytes, target: bytes) -> tuple[str, bytes]:
        raw = target.decode("latin-1")
        path, _, query = raw.partition("?")
        environ = {
            "REQUEST_METHOD": method.decode("latin-1"),
            "RAW_URI": raw,
            "PATH_INFO": unquote(path),
            "QUERY_STRING": query,
        }
        status: list[str] = []
        try:
            body = b"".join(self._app(environ, lambda s, headers, exc_info=None: status.append(s)))
        except Exception:
            log.exception("the sample app failed on %s", raw)
            return "500 Internal Server Error", b'{"error": "internal"}'
        return status[0], body


def _read_head(sock: socket.socket, buffered: bytes) -> tuple[bytes | None, bytes]:
    """One request head (without the blank line) and what followed it; ``None`` at end of stream."""
    searched = 0
    while True:
        end = buffered.find(b"\r\n\r\n", searched)
        if end >= 0:
            return buffered[:end], buffered[end + 4 :]
        if len(buffered) > MAX_HEAD_BYTES:
            raise _BadRequest("request head too large")
        searched = max(0, len(buffered) - 3)
        chunk = sock.recv(_RECV_BYTES)
        if not chunk:
            return None, b""
        buffered += chunk


def _parse_head(head: bytes) -> tuple[bytes, bytes, bool, int]:
    """``(method, target, keep_alive, body length)`` from a request head."""
    request_line, _, header_block = head.partition(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise _BadRequest("malformed request line")
    method, target, version = parts
    headers = {}
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    connection = headers.get(b"connection", b"")
    keep_alive = (
        b"close" not in connection if version == b"HTTP/1.1" else b"keep-alive" in connection
    )
    length = headers.get(b"content-length", b"0")
    if not length.isdigit():
        raise _BadRequest("bad Content-Length")
    return method, target, keep_alive, int(length)


def _skip_body(sock: socket.socket, buffered: bytes, length: int) -> bytes:
    while len(buffered) < length:
        chunk = sock.recv(_RECV_BYTES)
        if not chunk:
            raise OSError("end of stream inside a request body")
        buffered += chunk
    return buffered[length:]


def _http_response(status: str, body: bytes, *, keep_alive: bool) -> bytes:
    connection = b"" if keep_alive else b"Connection: close\r\n"
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n".encode("latin-1")
        + connection
        + b"\r\n"
        + body
    )


class BenchHttpBackends:
    """The sample alerts and metrics services (seeded), each on its own port of ``host``."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        delay_ms: float = 0,
        seed: int = DEFAULT_SEED,
        fail_every: int = 0,
    ) -> None:
        data = generate_sample_data(seed)
        self.alerts = LeanHttpServer(
            AlertsService(data), host=host, delay_ms=delay_ms, fail_every=fail_every
        )
        self.metrics = LeanHttpServer(
            MetricsService(data), host=host, delay_ms=delay_ms, fail_every=fail_every
        )

    def start(self) -> BenchHttpBackends:
        self.alerts.start()
        try:
            self.metrics.start()
        except Exception:
            self.alerts.stop()
            raise
        return self

    def stop(self) -> None:
        self.alerts.stop()
        self.metrics.stop()

    def __enter__(self) -> BenchHttpBackends:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.servers.http_backend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-every", type=int, default=0, help="0: never")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with BenchHttpBackends(
        host=args.host, delay_ms=args.delay_ms, fail_every=args.fail_every
    ) as backends:
        announce_ready(alerts_url=backends.alerts.url, metrics_url=backends.metrics.url)
        wait_for_stop_signal()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
