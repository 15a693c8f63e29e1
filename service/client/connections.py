"""The web-tier client's connections: opening them (TCP or TLS), and a bounded pool per instance.

A connection whose call ended in a transport error or timeout is closed, never
reused: a late reply must not be read as the answer to the next call. A pooled
connection idle for ``max_idle_s`` is closed instead of reused (the server may
be closing it right now). A connection answered ``Overloaded`` rests until its
``retry_after_ms`` has passed: the server paces each connection, and holds the
next refusal of one that comes back sooner (:mod:`service.overload.gate`), so
another call takes another connection, or a new one, meanwhile.
"""

from __future__ import annotations

import socket as _socket
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import gevent.lock
from thriftpy2.protocol import TCompactProtocol, TCyBinaryProtocol
from thriftpy2.thrift import TApplicationException, TClient
from thriftpy2.transport import (
    TCyBufferedTransport,
    TCyFramedTransport,
    TSocket,
    TTransportException,
)

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.idl import appstats
from service.wire.formats import PROTOCOLS, TRANSPORTS

__all__ = ["Connection", "ConnectionPool", "Connector"]

_TRANSPORT_CLASSES = dict(zip(TRANSPORTS, (TCyFramedTransport, TCyBufferedTransport)))
_PROTOCOL_CLASSES = dict(zip(PROTOCOLS, (TCyBinaryProtocol, TCompactProtocol)))
# Errors that arrive as a complete reply: the connection is still in step.
_REPLY_ERRORS = (
    TApplicationException,
    appstats.InvalidRequest,
    appstats.Overloaded,
    appstats.PanelFailed,
)


class Connection:
    """One open socket and the thriftpy2 client speaking over it."""

    __slots__ = ("socket", "client", "idle_since", "reused", "rest_until")

    def __init__(self, socket: TSocket, client: TClient) -> None:
        self.socket = socket
        self.client = client
        self.idle_since = 0.0  # set when the pool takes it back
        self.reused = False  # lent from the pool's idle ones, not opened for this call
        self.rest_until = 0.0  # answered Overloaded: not lent again before this moment

    def set_timeout_ms(self, timeout_ms: float) -> None:
        self.socket.set_timeout(max(1.0, timeout_ms))

    def close(self) -> None:
        self.socket.close()


class _TlsSocket(TSocket):
    """A client TSocket that verifies the server against ``context`` and ``server_hostname``."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext,
        server_hostname: str,
        socket_timeout: float,
        connect_timeout: float,
    ) -> None:
        super().__init__(host, port, socket_timeout=socket_timeout, connect_timeout=connect_timeout)
        self._context = context
        self._server_hostname = server_hostname

    def open(self) -> None:
        """Connect and complete the handshake within the connect timeout.

        Raises TTransportException(NOT_OPEN) with the reason on failure.
        """
        try:
            raw = _socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise TTransportException(
                TTransportException.NOT_OPEN, f"Could not connect to {self.host}:{self.port}: {exc}"
            ) from None
        try:
            raw.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            self.sock = self._context.wrap_socket(raw, server_hostname=self._server_hostname)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise TTransportException(
                TTransportException.NOT_OPEN,
                f"TLS handshake with {self.host}:{self.port} failed: "
                f"{getattr(exc, 'reason', None) or exc}",
            ) from None
        self.sock.settimeout(self.socket_timeout)


class ConnectionPool:
    """At most ``size`` open connections; idle ones are reused, broken ones closed."""

    def __init__(
        self,
        connect: Callable[[Deadline], Connection],
        size: int,
        max_idle_s: float,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: the client's, which idle and resting times read."""
        self._clock = clock
        self._connect = connect
        self._size = size
        self._max_idle_s = max_idle_s
        self._slots = gevent.lock.BoundedSemaphore(size)
        self._idle: list[Connection] = []
        self._closed = False

    @contextmanager
    def connection(self, deadline: Deadline, fresh: bool = False) -> Iterator[Connection]:
        """Lend a connection for one call (a new one if ``fresh``); raises
        TTransportException(TIMED_OUT) if none frees up before ``deadline``, or
        TTransportException(NOT_OPEN) when closed."""
        if self._closed:
            raise TTransportException(TTransportException.NOT_OPEN, "client is closed")
        if not self._slots.acquire(timeout=deadline.remaining_s()):
            raise TTransportException(
                TTransportException.TIMED_OUT,
                "no pooled connection became free before the deadline",
            )
        connection: Connection | None = None
        in_step = False
        try:
            connection = None if fresh else self._reusable()
            if connection is not None:
                connection.reused = True
            else:
                connection = self._connect(deadline)
            yield connection
            in_step = True
        except appstats.Overloaded as overloaded:
            in_step = True
            if connection is not None:
                connection.rest_until = (
                    self._clock.monotonic() + (overloaded.retry_after_ms or 0) / 1000.0
                )
            raise
        except _REPLY_ERRORS:
            in_step = True
            raise
        finally:
            if connection is not None:
                if in_step and not self._closed:
                    self._give_back(connection)
                else:
                    connection.close()
            self._slots.release()

    def _give_back(self, connection: Connection) -> None:
        connection.idle_since = self._clock.monotonic()
        self._idle.append(connection)
        if len(self._idle) > self._size:  # resting ones made room for new ones: keep size
            self._idle.pop(0).close()

    def _reusable(self) -> Connection | None:
        """The most recently used idle connection that is not too old nor resting after an
        ``Overloaded``; older ones are closed."""
        now = self._clock.monotonic()
        for index in range(len(self._idle) - 1, -1, -1):
            connection = self._idle[index]
            if now - connection.idle_since >= self._max_idle_s:
                del self._idle[index]
                connection.close()  # the server may be closing it right now: do not race it
            elif connection.rest_until <= now:
                del self._idle[index]
                return connection
        return None

    def close(self) -> None:
        """Close idle connections now; connections in use close when returned."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class Connector:
    """Opens connections to one ``host:port`` with the client's transport, protocol and TLS."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        transport: str,
        protocol: str,
        connect_timeout_ms: int,
        timeout_ms: int,
        tls: ssl.SSLContext | None,
        tls_server_hostname: str,
    ) -> None:
        self._host, self._port = host, port
        self._make_transport = _TRANSPORT_CLASSES[transport]
        self._make_protocol = _PROTOCOL_CLASSES[protocol]
        self._connect_timeout_ms = connect_timeout_ms
        self._timeout_ms = timeout_ms
        self._tls = tls
        self._tls_server_hostname = tls_server_hostname

    def __call__(self, deadline: Deadline) -> Connection:
        connect_timeout_ms = min(self._connect_timeout_ms, deadline.remaining_ms())
        if connect_timeout_ms < 1:
            raise TTransportException(
                TTransportException.TIMED_OUT, "deadline passed before connecting"
            )
        socket: TSocket
        if self._tls is not None:
            socket = _TlsSocket(
                self._host,
                self._port,
                self._tls,
                self._tls_server_hostname,
                socket_timeout=self._timeout_ms,
                connect_timeout=connect_timeout_ms,
            )
        else:
            socket = TSocket(
                self._host,
                self._port,
                socket_timeout=self._timeout_ms,
                connect_timeout=connect_timeout_ms,
            )
        transport = self._make_transport(socket)
        transport.open()  # raises TTransportException(NOT_OPEN) on failure
        return Connection(socket, TClient(appstats.AppStats, self._make_protocol(transport)))
