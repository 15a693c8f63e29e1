"""One connection's message loop: read a call, run it, write the reply, until the end.

Per call: read one bounded message (:mod:`service.wire.channel`), decode it with
the processor, run the handler in a fresh ``contextvars.Context``, write the
reply. Exceptions the IDL declares go back typed; anything else the handler
raises becomes ``TApplicationException(INTERNAL_ERROR, "internal error (request
id ...)")``, with the stack trace logged under that id, and the connection stays
usable. A malformed, oversized or too slow message closes only its own
connection, counted by kind in :class:`~service.listener.stats.ServerStats`.

A reply that pacing holds (a refusal to a caller back before its
``retry_after_ms``, :mod:`service.overload.gate`) is written once the hold is
over: by :mod:`service.overload.held_connections`, off this greenlet, where the
connection allows it, or else after a sleep here.
"""

from __future__ import annotations

import contextvars
import logging
import socket
from collections.abc import Callable
from typing import Any

import gevent
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.thrift import TApplicationException, TPayload, TProcessor

from lookups.clock import SYSTEM_CLOCK, Clock
from service.engine.summary import FailureSummary
from service.engine.tasks import new_request_id
from service.idl import appstats
from service.listener.handover import MoveNow
from service.listener.served import ServedConnection
from service.listener.stats import ServerStats
from service.overload.held_connections import HeldConnections, HeldReply, on_the_tick
from service.overload.pacing import ConnectionPacing, current_connection
from service.settings.server import ServerSettings
from service.wire.channel import Channel
from service.wire.channels import protocol_for
from service.wire.errors import WireError
from tracing.spans import CallDurations, set_call_endpoints

__all__ = ["MessageLoop", "RefuseUnread"]

log = logging.getLogger(__name__)

#: A call's result struct (a ``TPayload``) or a ``TApplicationException``; thriftpy2 is
#: untyped, so this is ``Any`` to the checker.
_Reply = Any
#: Given a connection's caller and a checked message, ``(method, seqid, reply)`` to answer
#: without reading it further, or None (:class:`service.overload.gate.UnreadRefusals`).
RefuseUnread = Callable[[ConnectionPacing, Any], tuple[str, int, TPayload] | None]


class _MalformedMessage(Exception):
    """The message could not be decoded; the stream can no longer be trusted."""


class MessageLoop:
    """Serves calls on connections with one processor; shared by all of a server's connections.

    ``stopping`` is set by the server when it drains: a connection then ends
    after the call it is serving.
    """

    def __init__(
        self,
        processor: TProcessor,
        settings: ServerSettings,
        stats: ServerStats,
        refuse_unread: RefuseUnread | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._processor = processor
        self._clock = clock  # the service's: its callers' pacing reads it
        self._refuse_unread = refuse_unread
        self._settings = settings
        self._stats = stats
        #: True from the start of the server's drain (a plain flag: read before every call).
        self.stopping = False
        self._make_protocol = protocol_for(settings.protocol)
        self._declared = FailureSummary(log, "declared exceptions answered", clock=clock)
        # A port scanner or a web client sends hundreds of bad connections a second:
        # one line per interval, by kind, with an example, never one per connection.
        self._rejected = FailureSummary(log, "connections closed for what they sent", clock=clock)
        self._durations = CallDurations(appstats.AppStats.thrift_services)
        self.held = HeldConnections(
            self._refuse_next,
            self._may_serve_more,
            settings.max_frame_bytes,
            self._durations,
            clock,
        )

    def open(self, sock: socket.socket) -> ServedConnection:
        """A :class:`ServedConnection` over ``sock``, with this loop's wire settings."""
        return ServedConnection(sock, self._settings, self._make_protocol, self._clock)

    def _may_serve_more(self, connection: ServedConnection) -> bool:
        """Whether a held connection may go on being served where it is held."""
        return not self.stopping and not self._too_old(connection)

    def _too_old(self, connection: ServedConnection) -> bool:
        max_age_ms = self._settings.max_connection_age_ms
        return (
            bool(max_age_ms)
            and (self._clock.monotonic() - connection.opened_at) * 1000.0 >= max_age_ms
        )

    def flush(self) -> None:
        """Log the pending summaries of declared exceptions and rejected connections (at
        shutdown)."""
        self._declared.flush()
        self._rejected.flush()

    def serve(self, connection: ServedConnection, peer: Any) -> bool:
        """Serve calls until the peer closes, idles out, errs, the server stops or the
        connection moves (True: it is another process's now); never raises."""
        try:
            # One pass per message; ends when the peer closes, idles out, the connection
            # reaches server.max_connection_age_ms (so load rebalances), moves, or we stop.
            while not connection.moving:
                if not (self._may_go_on(connection) and connection.channel.next_message()):
                    return False
                self._serve_one(connection)
            return self._move(connection)
        except MoveNow:  # interrupted while waiting for a call, nothing of it read
            return self._move(connection)
        except (WireError, _MalformedMessage) as refused:
            self._rejected.count(self._stats.count_closing(refused), f"{peer}: {refused}")
        except TimeoutError:
            log.debug(
                "connection from %s idle for %d ms; closing", peer, self._settings.idle_timeout_ms
            )
        except OSError as exc:
            log.debug("connection from %s ended: %s", peer, exc)
        except Exception:
            self._stats.internal_errors += 1
            log.exception("connection from %s failed", peer)
        return False

    def _move(self, connection: ServedConnection) -> bool:
        assert connection.moving is not None
        moved = connection.moving(connection.sock, connection.channel.unread())
        if moved:
            self._stats.connections_moved += 1
        return moved

    def _may_go_on(self, connection: ServedConnection) -> bool:
        if self._too_old(connection):
            return False
        if not self.stopping:
            return True
        # Draining: a call that already arrived was sent while we were still accepting (a
        # connection just accepted, or a pooled one): answer it rather than lose it. Only
        # once, so a peer sending call after call cannot hold the drain open.
        if connection.served_while_draining or not connection.channel.message_waiting():
            return False
        connection.served_while_draining = True
        return True

    def _serve_one(self, connection: ServedConnection) -> None:
        message = connection.channel.receive()
        started = self._clock.monotonic()
        api, seqid, reply = self._answer(connection, message)
        hold_s = connection.caller.take_hold()
        if self.stopping:
            hold_s = 0.0  # draining: a refusal goes out at once, the drain waits for no hold
        if not isinstance(reply, TApplicationException) and reply.oneway:
            self._durations.call_ended(api, _error_type(reply), self._clock.monotonic() - started)
            return
        held = self._held_reply(connection, api, seqid, reply, started, hold_s)
        payload = held.payload
        if hold_s > 0 and connection.channel.holdable:
            self._stats.replies_held += 1
            unsent = self.held.hold(connection, held)  # written and recorded there...
            if unsent is None:
                return
            held, payload, hold_s = unsent.reply, unsent.rest, 0.0  # ...but for this rest
        self._send(connection, held, payload, hold_s)

    def _answer(self, connection: ServedConnection, message: Any) -> tuple[str, int, _Reply]:
        """The call's method, seqid and reply: refused unread, or decoded and run."""
        refused = self._unread_refusal(connection, message)
        if refused is not None:
            return refused
        api, seqid, reply, call = self._decode_call(connection.channel, message)
        if call is not None:
            reply = self._invoke(api, call, reply, connection)
        return api, seqid, reply

    def _refuse_next(self, connection: ServedConnection, message: Any) -> HeldReply | None:
        """For a held connection (in a callback of the hub): the held reply to a call
        refused unread, or None to serve it in the connection's greenlet."""
        started = self._clock.monotonic()
        refused = self._unread_refusal(connection, message)
        if refused is None:
            return None
        self._stats.replies_held += 1
        self._stats.refused_while_held += 1
        return self._held_reply(connection, *refused, started, connection.caller.take_hold())

    def _unread_refusal(
        self, connection: ServedConnection, message: Any
    ) -> tuple[str, int, TPayload] | None:
        """``(method, seqid, reply)`` if the call is refused unread (counted), else None."""
        if self._refuse_unread is None:
            return None
        refused = self._refuse_unread(connection.caller, message)
        if refused is not None:
            self._stats.declared_errors += 1
            self._declared.tally(f"{refused[0]} Overloaded", "refused unread")
        return refused

    def _held_reply(
        self,
        connection: ServedConnection,
        api: str,
        seqid: int,
        reply: _Reply,
        started: float,
        hold_s: float,
    ) -> HeldReply:
        """The reply, encoded and framed, to write once ``hold_s`` has passed."""
        payload = connection.channel.framed(self._encoded(connection, api, seqid, reply))
        return HeldReply(api, _error_type(reply), started, payload, hold_s)

    def _send(
        self, connection: ServedConnection, reply: HeldReply, payload: bytes, hold_s: float
    ) -> None:
        """Write ``payload`` (all or the rest of ``reply``'s) after ``hold_s``; record the call."""
        error_type = reply.error_type
        try:
            if hold_s > 0:
                gevent.sleep(on_the_tick(gevent.get_hub().loop, hold_s))
            connection.channel.send_framed(payload)
        except BaseException as unwritten:
            error_type = type(unwritten).__name__
            raise
        finally:  # every call read is recorded once, its reply written or not
            self._durations.call_ended(
                reply.method, error_type, self._clock.monotonic() - reply.started
            )

    def _decode_call(
        self, channel: Channel, message: Any
    ) -> tuple[str, int, _Reply, Callable[[], Any] | None]:
        """Decode one call received whole. The single place where input is decoded."""
        try:
            result: tuple[str, int, Any, Callable[[], Any] | None] = self._processor.process_in(
                channel.decode(message)
            )
            return result
        except (OSError, WireError):
            raise
        except Exception as exc:
            raise _MalformedMessage(f"{type(exc).__name__}: {exc}") from exc

    def _invoke(
        self, api: str, call: Callable[[], Any], result: TPayload, connection: ServedConnection
    ) -> _Reply:
        try:
            # A fresh context per call: nothing one call sets can leak into the next.
            context = contextvars.Context()
            context.run(set_call_endpoints, connection.endpoints)
            context.run(current_connection.set, connection.caller)
            result.success = context.run(call)
        except TApplicationException as application_error:
            return application_error
        except Exception as exc:  # noqa: BLE001 - declared or not, every handler error is answered
            if not self._processor.handle_exception(exc, result):
                return self._internal_error(api, exc)
            # Declared: the caller has it typed. Counted, summarised every few seconds.
            self._stats.declared_errors += 1
            self._declared.count(f"{api} {type(exc).__name__}", exc)
        return result

    def _encoded(self, connection: ServedConnection, api: str, seqid: int, reply: _Reply) -> bytes:
        """The reply's message, encoded (unframed). No switch between clean and getvalue:
        the output buffer is the hub's."""
        output = connection.output
        output.clean()
        try:
            self._encode(connection.oprot, api, seqid, reply)
        except Exception as exc:  # noqa: BLE001 - the handler returned something the IDL cannot encode
            # Log first: a log handler may yield, and the buffer is shared by the hub.
            error = self._internal_error(api, exc)
            output.clean()
            connection.oprot = self._make_protocol(output)  # drop any half-written state
            self._encode(connection.oprot, api, seqid, error)
        result: bytes = output.getvalue()
        return result

    def _encode(self, oprot: TProtocolBase, api: str, seqid: int, reply: _Reply) -> None:
        if isinstance(reply, TApplicationException):
            self._processor.send_exception(oprot, api, reply, seqid)
        else:
            self._processor.send_result(oprot, api, reply, seqid)

    def _internal_error(self, api: str, exc: Exception) -> TApplicationException:
        request_id = new_request_id()
        self._stats.internal_errors += 1
        log.error("internal error in %s (request id %s)", api, request_id, exc_info=exc)
        return TApplicationException(
            TApplicationException.INTERNAL_ERROR, f"internal error (request id {request_id})"
        )


def _error_type(reply: _Reply) -> str:
    """The ``error.type`` of a reply: the declared exception's name, the application
    exception's, or empty for a normal answer."""
    if isinstance(reply, TApplicationException):
        return "TApplicationException"
    for name in getattr(reply, "__dict__", {}):
        if name != "success" and getattr(reply, name) is not None:
            return type(getattr(reply, name)).__name__
    return ""
