"""The evented Thrift server: accept loop, TLS, connection pool, graceful stop.

A gevent ``StreamServer`` accepts connections into a bounded pool of
``server.max_connections`` handlers; while the pool is full the server stops
accepting and new connections wait in the kernel's backlog. Each connection
serves one call after another until the peer closes, idles out
(``server.idle_timeout_ms``) or the server stops.

Each connection's calls are served by :class:`service.listener.connection.MessageLoop`.

With ``server.tls_cert_file`` and ``server.tls_key_file`` set, every accepted
connection first completes a TLS handshake (TLS 1.2 or later), mutual with
``server.tls_client_ca_file`` (:mod:`service.listener.handshakes`).

Stopping (:meth:`ThriftServer.stop`) drains: the listener closes at once (new
connections are refused), idle connections close at once, each busy connection
closes after its current call has been answered, and connections still busy
after ``server.drain_timeout_ms`` are killed. :attr:`ThriftServer.draining` is
true from the start of the drain.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from dataclasses import dataclass
from typing import Any

import gevent.event
from gevent.pool import Pool
from gevent.server import StreamServer
from thriftpy2.thrift import TProcessor

from lookups.clock import SYSTEM_CLOCK, Clock
from service.listener.connection import MessageLoop, RefuseUnread
from service.listener.handover import MoveSink, request_move
from service.listener.handshakes import TlsHandshakes
from service.listener.served import ServedConnection
from service.listener.stats import ServerStats
from service.operations.ports import cannot_listen
from service.settings.server import ServerSettings
from service.wire.accept import ResilientStreamServer
from service.wire.formats import TRANSPORTS

__all__ = ["ThriftServer", "ServerStats", "DrainReport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainReport:
    """What one :meth:`ThriftServer.stop` did.

    ``calls_in_flight`` counts the connections busy when the drain began (a
    call being received, run or answered); each was let finish (``finished``)
    or killed at the drain timeout (``killed``, which also counts any
    connection still in its TLS handshake then).
    """

    calls_in_flight: int = 0
    idle_closed: int = 0
    finished: int = 0
    killed: int = 0
    elapsed_ms: float = 0.0


class ThriftServer:
    """Serves one thriftpy2 ``TProcessor`` over TCP, per ``ServerSettings``.

    ``settings.transport`` ("framed" or "buffered") and ``settings.protocol``
    ("binary" or "compact") must match the clients'. Construction raises
    ValueError for any other value.
    """

    def __init__(
        self,
        processor: TProcessor,
        settings: ServerSettings,
        listener: socket.socket | None = None,
        refuse_unread: RefuseUnread | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: the service's, which its callers' pacing reads."""
        if settings.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {settings.transport!r}")
        self._settings = settings
        self._stats = ServerStats()
        self._connections: set[ServedConnection] = set()
        self._clock = clock
        self._loop = MessageLoop(processor, settings, self._stats, refuse_unread, clock)
        self._server: StreamServer | None = None
        # A socket already bound and listening (pre-forked workers share one).
        self._listener = listener
        self._tls = TlsHandshakes(settings, self._stats) if settings.tls_cert_file else None
        self._moving_all: MoveSink | None = None  # set by stop(move_to=...)
        self._lame_duck = False
        self._stopped = gevent.event.Event()
        self._drain_report = DrainReport()

    @property
    def stats(self) -> ServerStats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

    def enter_lame_duck(self) -> None:
        """Report DRAINING from now on while still accepting and serving (``server.lame_duck_ms``),
        so that load balancers and clients move away before :meth:`stop`."""
        self._lame_duck = True

    @property
    def draining(self) -> bool:
        """True in the lame-duck period and once :meth:`stop` has begun."""
        return self._lame_duck or self._loop.stopping

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``; raises RuntimeError before :meth:`start`."""
        if self._server is None:
            raise RuntimeError("server not started")
        host, port = self._server.address[:2]
        return host, port

    def start(self) -> None:
        """Bind, listen and accept in the background; returns once listening.

        Raises OSError if the address cannot be bound, RuntimeError if already
        started or stopped. (An unreadable TLS certificate or key already raised
        :class:`service.wire.tls.TlsConfigError` at construction.)
        """
        if self._server is not None or self._loop.stopping:
            raise RuntimeError("server already started or stopped")
        settings = self._settings
        bind_to = self._listener if self._listener is not None else (settings.host, settings.port)
        server = ResilientStreamServer(
            bind_to, self._serve_connection, spawn=Pool(settings.max_connections)
        )
        try:
            server.start()
        except OSError as exc:
            raise cannot_listen(settings.host, settings.port, exc) from exc
        self._server = server
        host, port = self.address
        log.info(
            "listening on %s:%d (%s transport, %s protocol%s, max %d connections)",
            host,
            port,
            settings.transport,
            settings.protocol,
            ", TLS" if self._tls is not None else "",
            settings.max_connections,
        )

    def serve_forever(self) -> None:
        """:meth:`start` if needed, then block until :meth:`stop` has finished."""
        if self._server is None:
            self.start()
        self._stopped.wait()

    @property
    def movable(self) -> bool:
        """Whether this server's connections can move to another process (not under TLS)."""
        return self._tls is None

    def connection_counts(self) -> tuple[int, int]:
        """Connections open, and of those the ones not already moving."""
        staying = sum(1 for connection in self._connections if connection.moving is None)
        return len(self._connections), staying

    def move_some(self, count: int, sink: MoveSink) -> int:
        """Move up to ``count`` connections to ``sink``, each at its next point between
        calls (:mod:`service.listener.handover`), those waiting for a call first; how many will."""
        if not self.movable or self._loop.stopping:
            return 0
        staying = [c for c in self._connections if c.moving is None]
        staying.sort(key=lambda connection: not connection.channel.waiting_idle)
        for connection in staying[:count]:
            request_move(connection, sink)
        return min(count, len(staying))

    def adopt(self, sock: socket.socket, unread: bytes) -> bool:
        """Serve a connection another process handed over, ``unread`` (bytes it had read
        of the next call) first. False, and ``sock`` closed, when this server cannot."""
        server = self._server
        if server is None or self._loop.stopping or server.pool is None or server.pool.full():
            sock.close()
            return False
        try:
            peer = sock.getpeername()
        except OSError:  # the peer went away while it moved
            sock.close()
            return False
        self._stats.connections_adopted += 1
        server.pool.spawn(self._serve_connection, sock, peer, unread)
        return True

    def stop(self, timeout_s: float | None = None, move_to: MoveSink | None = None) -> DrainReport:
        """Drain: stop accepting, let calls in flight finish, close every connection.

        The listener closes first, so new connections are refused. Idle
        connections close at once; each busy one closes after its current call
        is answered; those still busy after ``timeout_s`` (default
        ``server.drain_timeout_ms``) are killed. With ``move_to``, every connection
        that can move (:attr:`movable`) moves there instead of closing, idle ones
        at once, busy ones after their call. Safe to call more than once,
        from any greenlet: later calls wait for the first one to finish.
        """
        if timeout_s is None:
            timeout_s = self._settings.drain_timeout_ms / 1000.0
        if self._loop.stopping:
            self._stopped.wait(timeout_s)
            return self._drain_report
        if move_to is not None and self.movable:
            self._moving_all = move_to
            for connection in list(self._connections):
                request_move(connection, move_to)
        self._loop.stopping = True  # the one flag: the message loop reads it before each call
        try:
            if self._server is not None:
                self._drain_report = self._drain(self._server, timeout_s)
        finally:
            self._stopped.set()
        return self._drain_report

    def _drain(self, server: StreamServer, timeout_s: float) -> DrainReport:
        started = self._clock.monotonic()
        server.close()
        # Replies held for pacing are written now, and their connections go back to their
        # greenlets, which see the drain (service.overload.held_connections).
        self._loop.held.release_all()
        open_connections = [c for c in self._connections if c.moving is None]
        idle = sum(connection.close_if_idle() for connection in open_connections)
        busy = len(open_connections) - idle
        log.info(
            "drain: stopped accepting; %d calls in flight, %d idle connections closed%s",
            busy,
            idle,
            f", {len(self._connections) - len(open_connections)} moving"
            if self._moving_all
            else "",
        )
        # Every connection greenlet, including any accepted but not yet serving: those
        # see the stop before reading anything and end at once.
        handlers = server.pool
        # Real time, whatever the service's clock: the drain must end within the grace its
        # supervisor gives a stop (Kubernetes' terminationGracePeriodSeconds), which it counts so.
        handlers.join(timeout=timeout_s)
        killed = len(handlers)
        if killed:
            handlers.kill(block=True, timeout=1.0)
        report = DrainReport(
            calls_in_flight=busy,
            idle_closed=idle,
            finished=max(busy - killed, 0),
            killed=killed,
            elapsed_ms=round((self._clock.monotonic() - started) * 1000.0, 1),
        )
        self._loop.flush()
        self._loop.held.close()
        if self._tls is not None:
            self._tls.flush()
        if killed:
            log.warning(
                "drain: timeout of %.0f ms passed; %d calls finished, %d connections "
                "still busy were killed",
                timeout_s * 1000.0,
                report.finished,
                killed,
            )
        else:
            log.info(
                "drain: %d calls finished in %.0f ms; all connections closed",
                report.finished,
                report.elapsed_ms,
            )
        return report

    def _serve_connection(self, sock: socket.socket, peer: Any, unread: bytes = b"") -> None:
        self._stats.connections_open += 1
        self._stats.connections_total += 1
        connection: ServedConnection | None = None
        stream: socket.socket | None = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                stream = self._tls.secure(sock, peer)
            if stream is None:
                return
            stream.settimeout(self._settings.idle_timeout_ms / 1000.0)
            connection = self._loop.open(stream)
            if unread:
                connection.channel.push_back(unread)
            connection.greenlet = gevent.getcurrent()
            if self._moving_all is not None:  # accepted as the drain began: it moves too
                connection.moving = self._moving_all
            self._connections.add(connection)
            self._loop.serve(connection, peer)
        finally:
            if connection is not None:
                self._connections.discard(connection)
            self._stats.connections_open -= 1
            (stream or sock).close()
