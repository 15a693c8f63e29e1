"""A TCP proxy with switchable faults, in front of a real server (e.g. nx-27017).

Part of :mod:`service.samples.faults` (which re-exports it; the modes are listed there).
A request held by a delay or a pause is dropped, not delivered late, if its client
closes the connection meanwhile.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from typing import Any, Self

import gevent
from gevent.event import Event
from gevent.pool import Pool
from gevent.server import StreamServer

__all__ = ["TcpFaultProxy", "reset_socket"]

#: How long a stop lets the pumps of the connections it reset end (they end at once).
_STOP_GRACE_S = 0.05
_CHUNK_BYTES = 64 * 1024
_POLL_S = 0.05  # how often a held request checks that its client is still there
# A MongoDB wire message header is four int32s: length, requestID, responseTo, opCode.
_RESPONSE_TO_AT, _HEADER_BYTES = 8, 16


def reset_socket(sock: socket.socket) -> None:
    """Close ``sock`` so the peer sees a reset (RST), not an orderly close; never raises."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed
    sock.close()


class TcpFaultProxy:
    """A TCP proxy to ``target`` with switchable delay, pause, reset and a garbled reply; a
    context manager.

    A connection whose server cannot be reached is reset. When either side of a proxied
    connection closes, the other side is closed too (reset, if the first side was reset).
    :meth:`start` raises :class:`OSError` when the port cannot be bound.

    With ``ssl_context`` (a server context) clients speak TLS to the proxy, which
    speaks plain TCP to ``target``: a TLS-fronted server, as a sidecar would make one.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 2.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._target = target
        self._ssl_context = ssl_context
        self._host, self._port = host, port
        self._connect_timeout_s = connect_timeout_s
        self._delay_ms = 0
        self._garble_marker = b""
        self.garbled = 0
        self._flowing = Event()
        self._flowing.set()
        self._live: set[tuple[socket.socket, socket.socket]] = set()
        self._pool = Pool()
        self._server: StreamServer | None = None

    @property
    def address(self) -> tuple[str, int]:
        if not self._port:
            raise RuntimeError("the proxy was never started")
        return self._host, self._port

    @property
    def live_connections(self) -> int:
        return len(self._live)

    @property
    def greenlets(self) -> frozenset[gevent.Greenlet]:
        """The greenlets proxying connections now (so tests can tell them from the caller's)."""
        return frozenset(self._pool.greenlets)

    @property
    def target(self) -> tuple[str, int]:
        return self._target

    def set_target(self, target: tuple[str, int]) -> None:
        """Proxy new connections to ``target``; live ones keep their server."""
        self._target = target

    def set_delay_ms(self, delay_ms: int) -> None:
        self._delay_ms = max(0, delay_ms)

    def garble_next_reply(self, marker: bytes) -> None:
        """Give the next server reply holding ``marker`` a wrong ``responseTo`` (a MongoDB
        wire header's third field), as a connection whose stream slipped would: the driver
        reads it as an answer to another request. :attr:`garbled` counts those sent."""
        self._garble_marker = marker

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def reset_all(self) -> None:
        """Reset both sides of every live connection."""
        for pair in list(self._live):
            for sock in pair:
                reset_socket(sock)

    def start(self) -> Self:
        if self._server is None:
            self._pool = Pool()
            tls: dict[str, Any] = {"ssl_context": self._ssl_context} if self._ssl_context else {}
            server = StreamServer((self._host, self._port), self._serve, spawn=self._pool, **tls)
            server.start()
            self._server, self._port = server, server.server_port
        return self

    def stop(self) -> None:
        """Stop listening and reset every live connection; idempotent."""
        server, self._server = self._server, None
        self._flowing.set()
        self.reset_all()
        if server is not None:
            server.stop(timeout=_STOP_GRACE_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serve(self, client: socket.socket, address: Any) -> None:
        try:
            upstream = socket.create_connection(self._target, timeout=self._connect_timeout_s)
        except OSError:
            reset_socket(client)
            return
        upstream.settimeout(None)
        pair = (client, upstream)
        self._live.add(pair)
        pumps = [
            self._pool.spawn(self._pump, client, upstream, True),
            self._pool.spawn(self._pump, upstream, client, False),
        ]
        try:
            gevent.joinall(pumps, count=1)
            reset = any(pump.value for pump in pumps if pump.dead)
        finally:
            gevent.killall(pumps)
            self._live.discard(pair)
        for sock in pair:
            if reset:
                reset_socket(sock)
            else:
                sock.close()

    def _pump(self, source: socket.socket, sink: socket.socket, towards_server: bool) -> bool:
        """Forward until EOF (returns False) or a socket error (returns True: propagate a reset)."""
        try:
            while True:
                data = source.recv(_CHUNK_BYTES)
                if not data:
                    return False
                delay_s = self._delay_ms / 1000 if towards_server else 0.0
                if not self._hold(source, time.monotonic() + delay_s):
                    return False
                if not towards_server:
                    data = self._garbled(data)
                sink.sendall(data)
        except OSError:
            return True

    def _garbled(self, data: bytes) -> bytes:
        marker = self._garble_marker
        if not marker or marker not in data or len(data) < _HEADER_BYTES:
            return data
        self._garble_marker = b""
        self.garbled += 1
        (response_to,) = struct.unpack_from("<i", data, _RESPONSE_TO_AT)
        return (
            data[:_RESPONSE_TO_AT]
            + struct.pack("<i", response_to + 1)
            + data[_RESPONSE_TO_AT + 4 :]
        )

    def _hold(self, source: socket.socket, until: float) -> bool:
        """Wait out the delay and any pause; False if ``source`` closed meanwhile.

        A request whose client gave up is dropped rather than delivered late, as a server
        would drop the work of a client that has gone, so it cannot slow later requests.
        """
        while time.monotonic() < until or not self._flowing.is_set():
            gevent.sleep(min(max(until - time.monotonic(), 0.0), _POLL_S) or _POLL_S)
            if _peer_closed(source):
                return False
        return True


def _peer_closed(sock: socket.socket) -> bool:
    """True when ``sock``'s peer has closed or reset it and nothing more is waiting to be read."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
