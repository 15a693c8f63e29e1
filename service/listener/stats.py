"""The server's counters since start, and how a connection closed for what it sent counts."""

from __future__ import annotations

from dataclasses import dataclass

from service.wire.errors import LimitExceeded, MessageTooSlow, ReplyNotTaken

__all__ = ["ServerStats"]


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
    ``replies_held`` counts the replies held for pacing off their connection's
    greenlet (:mod:`service.overload.held_connections`), and ``refused_while_held`` the
    calls refused unread there, without waking that greenlet.
    """

    connections_open: int = 0
    connections_total: int = 0
    frames_rejected: int = 0
    limits_exceeded: int = 0
    malformed_messages: int = 0
    slow_messages: int = 0
    slow_readers: int = 0
    internal_errors: int = 0
    declared_errors: int = 0  # calls answered with an exception the IDL declares
    tls_refused: int = 0
    replies_held: int = 0
    refused_while_held: int = 0
    connections_moved: int = 0  # handed to another worker between calls (service.listener.handover)
    connections_adopted: int = 0  # taken over from another worker

    def count_closing(self, exc: Exception) -> str:
        """Count a connection closed for what the peer sent (``exc``); its kind for the log."""
        if isinstance(exc, ReplyNotTaken):
            self.slow_readers += 1
            return "reply not taken in time"
        self.frames_rejected += 1
        if isinstance(exc, LimitExceeded):
            self.limits_exceeded += 1
            looks_like = getattr(exc, "looks_like", "")
            return f"{looks_like} sent to the Thrift port" if looks_like else "limit exceeded"
        if isinstance(exc, MessageTooSlow):
            self.slow_messages += 1
            return "message too slow"
        self.malformed_messages += 1
        return "malformed message"
