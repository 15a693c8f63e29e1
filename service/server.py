"""The evented Thrift server: accept loop, per-connection message loop, graceful stop.

A gevent ``StreamServer`` accepts connections into a bounded pool of
``server.max_connections`` handlers; while the pool is full the server stops
accepting and new connections wait in the kernel's backlog. Each connection
serves one call after another until the peer closes, idles out
(``server.idle_timeout_ms``) or the server stops.

Per call: read one bounded message (:mod:`service.transport`), decode it with
the processor, run the handler, write the reply. Exceptions the IDL declares go
back typed; anything else the handler raises becomes
``TApplicationException(INTERNAL_ERROR, "internal error (request id ...)")``,
with the stack trace logged under that id, and the connection stays usable.
A malformed or oversized message closes only its own connection.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import gevent.event
from gevent.pool import Pool
from gevent.server import StreamServer
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.thrift import TApplicationException, TPayload, TProcessor

from service.config import ServerSettings
from service.context import new_request_id
from service.transport import (
    TRANSPORTS, Channel, FrameRejected, new_output_buffer, open_channel, protocol_for,
)

__all__ = ["ThriftServer", "ServerStats"]

log = logging.getLogger(__name__)

_Reply = TPayload | TApplicationException


@dataclass
class ServerStats:
    """Counters since start. ``frames_rejected`` counts oversized or negative
    lengths and messages that failed to decode; each closed its connection."""

    connections_open: int = 0
    connections_total: int = 0
    frames_rejected: int = 0
    internal_errors: int = 0


class _MalformedMessage(Exception):
    """The message could not be decoded; the stream can no longer be trusted."""


class _Connection:
    """One accepted socket with its reusable input and output protocols."""

    __slots__ = ("sock", "channel", "iprot", "output", "oprot")

    def __init__(self, sock: socket.socket, settings: ServerSettings,
                 make_protocol: Callable[[Any], TProtocolBase]) -> None:
        self.sock = sock
        self.channel: Channel = open_channel(settings.transport, sock, settings.max_frame_bytes)
        self.iprot = make_protocol(self.channel.input)
        self.output = new_output_buffer()
        self.oprot = make_protocol(self.output)

    def close_if_idle(self) -> None:
        """End the connection if it is waiting for a new message, so none is lost."""
        if self.channel.idle:
            try:
                # The blocked read then sees end-of-stream and the loop ends normally.
                self.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass


class ThriftServer:
    """Serves one thriftpy2 ``TProcessor`` over TCP, per ``ServerSettings``.

    ``settings.transport`` ("framed" or "buffered") and ``settings.protocol``
    ("binary" or "compact") must match the clients'. Construction raises
    ValueError for any other value.
    """

    def __init__(self, processor: TProcessor, settings: ServerSettings,
                 listener: Optional[socket.socket] = None) -> None:
        if settings.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {settings.transport!r}")
        self._processor = processor
        self._settings = settings
        self._make_protocol = protocol_for(settings.protocol)
        self._stats = ServerStats()
        self._connections: set[_Connection] = set()
        self._server: Optional[StreamServer] = None
        # A socket already bound and listening (pre-forked workers share one).
        self._listener = listener
        self._stopping = False
        self._stopped = gevent.event.Event()

    @property
    def stats(self) -> ServerStats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

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
        started or stopped.
        """
        if self._server is not None or self._stopping:
            raise RuntimeError("server already started or stopped")
        settings = self._settings
        bind_to = self._listener if self._listener is not None else (settings.host, settings.port)
        server = StreamServer(bind_to, self._serve_connection, spawn=Pool(settings.max_connections))
        server.start()
        self._server = server
        host, port = self.address
        log.info("listening on %s:%d (%s transport, %s protocol, max %d connections)",
                 host, port, settings.transport, settings.protocol, settings.max_connections)

    def serve_forever(self) -> None:
        """:meth:`start` if needed, then block until :meth:`stop` has finished."""
        if self._server is None:
            self.start()
        self._stopped.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let calls in progress finish, close every connection.

        Idle connections close at once; connections still busy after
        ``timeout_s`` are killed. Safe to call more than once, from any greenlet.
        """
        if self._stopping:
            self._stopped.wait(timeout_s)
            return
        self._stopping = True
        server = self._server
        if server is not None:
            server.close()
            for connection in list(self._connections):
                connection.close_if_idle()
            server.stop(timeout=timeout_s)
            log.info("stopped")
        self._stopped.set()

    def _serve_connection(self, sock: socket.socket, peer: Any) -> None:
        self._stats.connections_open += 1
        self._stats.connections_total += 1
        connection: Optional[_Connection] = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._settings.idle_timeout_ms / 1000.0)
            connection = _Connection(sock, self._settings, self._make_protocol)
            self._connections.add(connection)
            self._serve_messages(connection, peer)
        finally:
            if connection is not None:
                self._connections.discard(connection)
            self._stats.connections_open -= 1
            sock.close()

    def _serve_messages(self, connection: _Connection, peer: Any) -> None:
        try:
            # One pass per message; ends when the peer closes, idles out or we stop.
            while not self._stopping and connection.channel.next_message():
                self._serve_one(connection)
        except FrameRejected as exc:
            self._stats.frames_rejected += 1
            log.warning("closing connection from %s: %s", peer, exc)
        except _MalformedMessage as exc:
            self._stats.frames_rejected += 1
            log.warning("closing connection from %s: malformed message (%s)", peer, exc)
        except TimeoutError:
            log.debug("connection from %s idle for %d ms; closing", peer,
                      self._settings.idle_timeout_ms)
        except OSError as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        except Exception:
            self._stats.internal_errors += 1
            log.exception("connection from %s failed", peer)

    def _serve_one(self, connection: _Connection) -> None:
        api, seqid, reply, call = self._read_call(connection.iprot)
        if call is not None:
            reply = self._invoke(api, call, reply)
        if isinstance(reply, TApplicationException) or not reply.oneway:
            self._write_reply(connection, api, seqid, reply)

    def _read_call(self, iprot: TProtocolBase) -> tuple[str, int, _Reply, Optional[Callable[[], Any]]]:
        """Decode one call. The single place where input is decoded."""
        try:
            return self._processor.process_in(iprot)
        except (OSError, FrameRejected):
            raise
        except Exception as exc:
            raise _MalformedMessage(f"{type(exc).__name__}: {exc}") from exc

    def _invoke(self, api: str, call: Callable[[], Any], result: TPayload) -> _Reply:
        try:
            # A fresh context per call: nothing one call sets can leak into the next.
            result.success = contextvars.Context().run(call)
        except TApplicationException as exc:
            return exc
        except Exception as exc:
            if not self._processor.handle_exception(exc, result):
                return self._internal_error(api, exc)
            log.warning("%s raised %s: %s", api, type(exc).__name__, exc)
        return result

    def _write_reply(self, connection: _Connection, api: str, seqid: int, reply: _Reply) -> None:
        output = connection.output
        output.clean()
        try:
            self._encode(connection.oprot, api, seqid, reply)
        except Exception as exc:  # the handler returned something the IDL cannot encode
            output.clean()
            connection.oprot = self._make_protocol(output)  # drop any half-written state
            self._encode(connection.oprot, api, seqid, self._internal_error(api, exc))
        connection.channel.send(output.getvalue())

    def _encode(self, oprot: TProtocolBase, api: str, seqid: int, reply: _Reply) -> None:
        if isinstance(reply, TApplicationException):
            self._processor.send_exception(oprot, api, reply, seqid)
        else:
            self._processor.send_result(oprot, api, reply, seqid)

    def _internal_error(self, api: str, exc: Exception) -> TApplicationException:
        request_id = new_request_id()
        self._stats.internal_errors += 1
        log.error("internal error in %s (request id %s)", api, request_id, exc_info=exc)
        return TApplicationException(TApplicationException.INTERNAL_ERROR,
                                     f"internal error (request id {request_id})")
