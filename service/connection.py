"""One connection's message loop: read a call, run it, write the reply, until the end.

Per call: read one bounded message (:mod:`service.wire.channel`), decode it with
the processor, run the handler in a fresh ``contextvars.Context``, write the
reply. Exceptions the IDL declares go back typed; anything else the handler
raises becomes ``TApplicationException(INTERNAL_ERROR, "internal error (request
id ...)")``, with the stack trace logged under that id, and the connection stays
usable. A malformed, oversized or too slow message closes only its own
connection, counted by kind in :class:`ServerStats`.
"""

from __future__ import annotations

import contextvars
import logging
import socket
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.thrift import TApplicationException, TPayload, TProcessor

from service.server_settings import ServerSettings
from service.engine.context import new_request_id
from service.engine.pacing import CallerPacing, current_caller
from service.engine.summary import FailureSummary
from service.rpc_metrics import call_ended
from service.wire.channel import Channel, open_channel, protocol_for, shared_output_buffer
from service.wire.errors import (
    LimitExceeded, MessageTooSlow, ReplyNotTaken, WireError,
)
from service.wire.scan import WireLimits
from tracing.spans import set_call_endpoints

__all__ = ["Connection", "MessageLoop", "ServerStats"]

log = logging.getLogger(__name__)

_Reply = TPayload | TApplicationException
#: Given a connection's caller and a checked message, ``(method, seqid, reply)`` to answer
#: without reading it further, or None (:class:`service.shedding.UnreadRefusals`).
RefuseUnread = Callable[[CallerPacing, Any], Optional[tuple[str, int, TPayload]]]


@dataclass
class ServerStats:
    """Counters since start.

    ``frames_rejected`` counts every incoming message refused, each of which
    closed its connection: over a limit (``limits_exceeded``: frame, string,
    container or nesting depth), malformed or undecodable (``malformed_messages``),
    or not complete within ``server.frame_timeout_ms`` (``slow_messages``).
    ``slow_readers`` counts connections closed because the peer did not take
    its reply within ``server.frame_timeout_ms``. ``tls_refused`` counts
    connections closed in or right after their TLS handshake (failed, stalled,
    no or an untrusted client certificate, or a client name not allowed).
    """

    connections_open: int = 0
    connections_total: int = 0
    frames_rejected: int = 0
    limits_exceeded: int = 0
    malformed_messages: int = 0
    slow_messages: int = 0
    slow_readers: int = 0
    internal_errors: int = 0
    declared_errors: int = 0    # calls answered with an exception the IDL declares
    tls_refused: int = 0


class _MalformedMessage(Exception):
    """The message could not be decoded; the stream can no longer be trusted."""


class Connection:
    """One accepted socket with its reusable input and output protocols."""

    __slots__ = ("sock", "channel", "output", "oprot", "opened_at", "endpoints", "caller",
                 "served_while_draining")

    def __init__(self, sock: socket.socket, settings: ServerSettings,
                 make_protocol: Callable[[Any], TProtocolBase]) -> None:
        self.sock = sock
        self.opened_at = time.monotonic()
        self.channel: Channel = open_channel(settings.transport, sock,
                                             WireLimits.from_settings(settings), settings.protocol)
        # The hub's reply buffer: MessageLoop fills and empties it without a switch.
        self.output = shared_output_buffer()
        self.oprot = make_protocol(self.output)
        # For the SERVER span of every call on this connection (tracing.spans.set_call_endpoints).
        self.endpoints = _endpoints(sock)
        # One caller per connection: its refusals are paced (service.engine.pacing).
        self.caller = CallerPacing()
        self.served_while_draining = False

    def close_if_idle(self) -> bool:
        """End the connection if it is waiting for a new message, so none is lost.

        True if it was idle. A message that has arrived but is not read yet makes it busy:
        its caller sent it while we were serving, and it is answered before the end.
        """
        if not self.channel.idle or self.channel.message_waiting():
            return False
        try:
            # The blocked read then sees end-of-stream and the loop ends normally. The
            # plain socket's shutdown, also under TLS: ssl's own would unwrap the socket
            # under the blocked read, which then fails instead of ending.
            socket.socket.shutdown(self.sock, socket.SHUT_RD)
        except OSError:
            pass
        return True


class MessageLoop:
    """Serves calls on connections with one processor; shared by all of a server's connections.

    ``stopping`` says whether the server is draining: a connection then ends
    after the call it is serving.
    """

    def __init__(self, processor: TProcessor, settings: ServerSettings, stats: ServerStats,
                 stopping: Callable[[], bool], refuse_unread: Optional[RefuseUnread] = None) -> None:
        self._processor = processor
        self._refuse_unread = refuse_unread
        self._settings = settings
        self._stats = stats
        self._stopping = stopping
        self._make_protocol = protocol_for(settings.protocol)
        self._declared = FailureSummary(log, "declared exceptions answered")
        # A port scanner or a web client sends hundreds of bad connections a second:
        # one line per interval, by kind, with an example, never one per connection.
        self._rejected = FailureSummary(log, "connections closed for what they sent")

    def open(self, sock: socket.socket) -> Connection:
        """A :class:`Connection` over ``sock``, with this loop's wire settings."""
        return Connection(sock, self._settings, self._make_protocol)

    def _too_old(self, connection: Connection) -> bool:
        max_age_ms = self._settings.max_connection_age_ms
        return bool(max_age_ms) and (time.monotonic() - connection.opened_at) * 1000.0 >= max_age_ms

    def flush(self) -> None:
        """Log the pending summaries of declared exceptions and rejected connections (at shutdown)."""
        self._declared.flush()
        self._rejected.flush()

    def serve(self, connection: Connection, peer: Any) -> None:
        """Serve calls until the peer closes, idles out, errs or the server stops; never raises."""
        try:
            # One pass per message; ends when the peer closes, idles out, the connection
            # reaches server.max_connection_age_ms (so load rebalances) or we stop.
            while self._may_go_on(connection) and connection.channel.next_message():
                self._serve_one(connection)
        except (WireError, _MalformedMessage) as exc:
            self._rejected.count(self._book_rejection(exc), f"{peer}: {exc}")
        except TimeoutError:
            log.debug("connection from %s idle for %d ms; closing", peer,
                      self._settings.idle_timeout_ms)
        except OSError as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        except Exception:
            self._stats.internal_errors += 1
            log.exception("connection from %s failed", peer)

    def _may_go_on(self, connection: Connection) -> bool:
        if self._too_old(connection):
            return False
        if not self._stopping():
            return True
        # Draining: a call that already arrived was sent while we were still accepting (a
        # connection just accepted, or a pooled one): answer it rather than lose it. Only
        # once, so a peer sending call after call cannot hold the drain open.
        if connection.served_while_draining or not connection.channel.message_waiting():
            return False
        connection.served_while_draining = True
        return True

    def _book_rejection(self, exc: Exception) -> str:
        """Count a closing for what the peer sent in :class:`ServerStats`; its kind for the log."""
        if isinstance(exc, ReplyNotTaken):
            self._stats.slow_readers += 1
            return "reply not taken in time"
        self._stats.frames_rejected += 1
        if isinstance(exc, LimitExceeded):
            self._stats.limits_exceeded += 1
            looks_like = getattr(exc, "looks_like", "")
            return f"{looks_like} sent to the Thrift port" if looks_like else "limit exceeded"
        if isinstance(exc, MessageTooSlow):
            self._stats.slow_messages += 1
            return "message too slow"
        self._stats.malformed_messages += 1
        return "malformed message"

    def _serve_one(self, connection: Connection) -> None:
        message = connection.channel.receive()
        started = time.perf_counter()
        refused = (self._refuse_unread(connection.caller, message)
                   if self._refuse_unread is not None else None)
        if refused is not None:
            api, seqid, reply = refused
            call = None
            self._stats.declared_errors += 1
            self._declared.count(f"{api} Overloaded", "refused unread")
        else:
            api, seqid, reply, call = self._decode_call(connection.channel, message)
        if call is not None:
            reply = self._invoke(api, call, reply, connection)
        error_type = _error_type(reply)
        try:
            if isinstance(reply, TApplicationException) or not reply.oneway:
                self._write_reply(connection, api, seqid, reply)
        except Exception as unwritten:
            error_type = type(unwritten).__name__
            raise
        finally:  # every call read is recorded once, its reply written or not
            call_ended(api, error_type, time.perf_counter() - started)

    def _decode_call(self, channel: Channel,
                     message: Any) -> tuple[str, int, _Reply, Optional[Callable[[], Any]]]:
        """Decode one call received whole. The single place where input is decoded."""
        try:
            return self._processor.process_in(channel.decode(message))
        except (OSError, WireError):
            raise
        except Exception as exc:
            raise _MalformedMessage(f"{type(exc).__name__}: {exc}") from exc

    def _invoke(self, api: str, call: Callable[[], Any], result: TPayload,
                connection: Connection) -> _Reply:
        try:
            # A fresh context per call: nothing one call sets can leak into the next.
            context = contextvars.Context()
            context.run(set_call_endpoints, connection.endpoints)
            context.run(current_caller.set, connection.caller)
            result.success = context.run(call)
        except TApplicationException as exc:
            return exc
        except Exception as exc:
            if not self._processor.handle_exception(exc, result):
                return self._internal_error(api, exc)
            # Declared: the caller has it typed. Counted, summarised every few seconds.
            self._stats.declared_errors += 1
            self._declared.count(f"{api} {type(exc).__name__}", exc)
        return result

    def _write_reply(self, connection: Connection, api: str, seqid: int, reply: _Reply) -> None:
        output = connection.output
        output.clean()
        try:
            self._encode(connection.oprot, api, seqid, reply)
        except Exception as exc:  # the handler returned something the IDL cannot encode
            # Log first: a log handler may yield, and the buffer is shared by the hub.
            error = self._internal_error(api, exc)
            output.clean()
            connection.oprot = self._make_protocol(output)  # drop any half-written state
            self._encode(connection.oprot, api, seqid, error)
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


def _endpoints(sock: socket.socket) -> Mapping[str, Any]:
    """The semantic conventions' network attributes of an accepted TCP connection."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:  # already reset by the peer: its calls will fail on their own
        return {}
    if not (isinstance(local, tuple) and isinstance(peer, tuple)):
        return {}
    return MappingProxyType({
        "server.address": local[0], "server.port": local[1],
        "client.address": peer[0], "client.port": peer[1],
        "network.peer.address": peer[0], "network.peer.port": peer[1],
        "network.transport": "tcp"})


def _error_type(reply: _Reply) -> str:
    """The ``error.type`` of a reply: the declared exception's name, the application
    exception's, or empty for a normal answer."""
    if isinstance(reply, TApplicationException):
        return "TApplicationException"
    for name in getattr(reply, "__dict__", {}):
        if name != "success" and getattr(reply, name) is not None:
            return type(getattr(reply, name)).__name__
    return ""
