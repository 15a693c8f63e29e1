"""Why the server closed a connection because of what came over the wire.

Every error here means the byte stream can no longer be trusted to be in step
with the messages in it, so the connection is closed (never the server, never
another connection). The server logs each at warning and counts it::

    WireError
    +-- MessageRejected          an incoming message was refused
    |   +-- LimitExceeded        a size, count or depth limit was exceeded
    |   |   +-- FrameRejected    frame length (or unframed message) over server.max_frame_bytes
    |   +-- MalformedMessage     not a well-formed Thrift message (e.g. claims bytes it lacks)
    |   +-- MessageTooSlow       the message did not arrive within server.frame_timeout_ms
    +-- ReplyNotTaken            the peer did not read its reply within server.frame_timeout_ms
"""

from __future__ import annotations

__all__ = [
    "WireError",
    "MessageRejected",
    "LimitExceeded",
    "FrameRejected",
    "MalformedMessage",
    "MessageTooSlow",
    "ReplyNotTaken",
]


class WireError(Exception):
    """The peer broke a rule of the wire; close its connection."""


class MessageRejected(WireError):
    """An incoming message was refused before (or instead of) being decoded."""


class LimitExceeded(MessageRejected):
    """A string, container, nesting depth or message size over its configured limit."""


class FrameRejected(LimitExceeded):
    """A frame or unframed message larger than the limit, or a negative frame length.

    Raised before the body is allocated or read.
    """

    def __init__(self, length: int | None, limit: int) -> None:
        self.length = length
        self.limit = limit
        self.looks_like = _foreign_protocol(length)
        if length is None:
            super().__init__(f"message longer than the {limit}-byte limit")
        elif self.looks_like:
            super().__init__(
                f"frame length {length} outside 0..{limit} bytes: the bytes "
                f"looked like {self.looks_like}, not framed Thrift"
            )
        else:
            super().__init__(f"frame length {length} outside 0..{limit} bytes")


#: The first bytes of what is often sent to a Thrift port by mistake.
_HTTP_METHODS = (
    b"GET ",
    b"POST",
    b"PUT ",
    b"HEAD",
    b"DELE",
    b"OPTI",
    b"PATC",
    b"CONN",
    b"TRAC",
    b"PRI ",
)


def _foreign_protocol(length: int | None) -> str:
    """``"HTTP"`` or ``"TLS"`` when a frame length's four bytes start such a request."""
    if length is None:
        return ""
    head = (length & 0xFFFFFFFF).to_bytes(4, "big")
    if head in _HTTP_METHODS:
        return "HTTP"
    if head[0] == 0x16 and head[1] == 0x03:  # a TLS handshake record
        return "TLS"
    return ""


class MalformedMessage(MessageRejected):
    """Not a well-formed Thrift message: bad header, unknown type, a length or count
    that claims more bytes than the message holds, bytes after its end, ..."""


class MessageTooSlow(MessageRejected):
    """The rest of a message did not arrive within ``server.frame_timeout_ms`` of its first byte."""


class ReplyNotTaken(WireError):
    """The peer did not read a reply within ``server.frame_timeout_ms``."""
