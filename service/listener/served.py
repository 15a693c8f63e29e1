"""One connection as the server serves it: its socket, channel and reply protocol, its
caller's pacing, and where it moves (:mod:`service.listener.handover`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import gevent
from thriftpy2.protocol.base import TProtocolBase

from lookups.clock import SYSTEM_CLOCK, Clock
from service.listener.handover import MoveSink
from service.overload.pacing import ConnectionPacing
from service.settings.server import ServerSettings
from service.wire.channel import Channel
from service.wire.channels import open_channel, shared_output_buffer
from service.wire.tls import client_identity
from tracing.spans import connection_endpoints

__all__ = ["ServedConnection"]


class ServedConnection:
    """One accepted socket with its reusable input and output protocols (the client's side
    of a connection is :class:`service.client.connections.Connection`)."""

    __slots__ = (
        "sock",
        "channel",
        "output",
        "oprot",
        "opened_at",
        "endpoints",
        "caller",
        "served_while_draining",
        "greenlet",
        "moving",
    )

    def __init__(
        self,
        sock: socket.socket,
        settings: ServerSettings,
        make_protocol: Callable[[Any], TProtocolBase],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: the service's, which its caller's pacing reads (deadlines read it too)."""
        self.sock = sock
        self.opened_at = clock.monotonic()
        self.channel: Channel = open_channel(
            settings.transport, sock, settings.wire_limits(), settings.protocol
        )
        # The hub's reply buffer: MessageLoop fills and empties it without a switch.
        self.output = shared_output_buffer()
        self.oprot = make_protocol(self.output)
        # For the SERVER span of every call on this connection (tracing.spans.set_call_endpoints).
        self.endpoints = connection_endpoints(sock)
        # One caller per connection: its refusals are paced (service.overload.gate), and its
        # client certificate, if any, names it for fair share (service.overload.fair_share).
        self.caller = ConnectionPacing(clock, client_identity(sock, settings.tls_client_names))
        self.served_while_draining = False
        # The greenlet serving it, and where it moves at its next point between calls
        # (service.listener.handover), if it is to move.
        self.greenlet: gevent.Greenlet | None = None
        self.moving: MoveSink | None = None

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
