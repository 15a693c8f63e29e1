"""Bounded Thrift message input and output on one server connection.

A channel receives one message at a time in two steps, each under its own time
bound: :meth:`~Channel.next_message` waits (``idle_timeout_ms``) for the first
bytes of the next message, then :meth:`~Channel.read_message` receives the rest
(all of it within ``frame_timeout_ms`` of its first byte), checks it against
the size limits (:mod:`service.wire.scan`) and returns a protocol ready to
decode it. :class:`FramedChannel` checks the declared frame length before
allocating; :class:`~service.wire.channels.BufferedChannel` scans the message as it
arrives to find its end. The decoder is given one whole, checked message and nothing
else. An idle connection holds no buffer; decoding and reply encoding use one transport
and one buffer per gevent hub (:mod:`service.wire.codec`).

Errors (see :mod:`service.wire.errors`): :class:`MessageRejected` subclasses for
a message refused (too big, over a limit, malformed, too slow);
:class:`ReplyNotTaken` when the peer does not read a reply in time; ``OSError``
(``TimeoutError`` when idle too long, :class:`PeerClosed`) when the connection
fails or the peer goes away.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
from typing import Any, Protocol

import gevent.ssl
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.transport.buffered import TCyBufferedTransport

from lookups.clock import SYSTEM_CLOCK
from service.wire.codec import decoder_for, hub_codec
from service.wire.errors import FrameRejected, MessageRejected, MessageTooSlow, ReplyNotTaken
from service.wire.scan import WireLimits, check_frame

__all__ = [
    "FrameRejected",
    "MessageRejected",
    "PeerClosed",
    "Channel",
    "SocketChannel",
    "FramedChannel",
    "WireLimits",
]


_FRAME_HEADER = struct.Struct("!i")
_TLS_SOCKETS = (ssl.SSLSocket, gevent.ssl.SSLSocket)
# The most one receive asks for: a typical call (or a burst of pipelined ones) in one read.
READ_BYTES = 64 * 1024


class PeerClosed(ConnectionError):
    """The peer closed the connection (possibly in the middle of a message)."""


class Channel(Protocol):
    """One connection's message input and reply output."""

    #: True while waiting for the first byte of the next message: closing the
    #: connection then loses no call.
    idle: bool
    #: True while blocked waiting for the next call (a hand-over may take it then).
    waiting_idle: bool

    def message_waiting(self) -> bool: ...

    def next_message(self) -> bool: ...

    def read_message(self) -> TProtocolBase: ...

    def receive(self) -> Any: ...

    def decode(self, message: Any) -> TProtocolBase: ...

    def send(self, payload: bytes) -> None: ...

    @property
    def holdable(self) -> bool: ...

    def push_back(self, data: bytes) -> None: ...

    def unread(self) -> bytes: ...

    def framed(self, payload: bytes) -> bytes: ...

    def send_framed(self, payload: bytes) -> None: ...


class SocketChannel:
    """What both transports share: receiving under the idle and frame bounds, sending."""

    __slots__ = (
        "_sock",
        "_limits",
        "_codec",
        "_decode",
        "_buffer",
        "_start",
        "_deadline",
        "_timeout",
        "idle",
        "waiting_idle",
    )

    def __init__(
        self, sock: socket.socket, limits: WireLimits | int, protocol: str = "binary"
    ) -> None:
        self._sock = sock
        # An int is the frame limit alone, with every other limit at its default.
        self._limits = (
            limits if isinstance(limits, WireLimits) else WireLimits(max_frame_bytes=limits)
        )
        self._codec = hub_codec()
        self._decode = decoder_for(protocol, self._codec)
        self._buffer: Any = b""  # bytes received and not yet handed out, from _start on
        self._start = 0
        self._deadline = 0.0
        self._timeout: float | None = None  # last timeout set on the socket
        self.idle = True
        # True only while blocked in the read of a new message's first bytes: nothing of
        # it has been read, so the connection can move to another process then.
        self.waiting_idle = False

    def message_waiting(self) -> bool:
        """Has the peer sent something not yet read? Never waits.

        Under TLS the bytes may still be encrypted; they are a message on its way all the same.
        """
        if self._start < len(self._buffer):
            return True
        try:
            if getattr(self._sock, "pending", lambda: 0)():  # TLS: decrypted, not yet read
                return True
            # Zero timeout: the (patched) select only polls.
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):  # closed under us
            return False
        return bool(readable)

    def next_message(self) -> bool:
        """Wait for the next message to begin; False if the peer closed cleanly first.

        Raises ``TimeoutError`` after ``idle_timeout_ms`` without a byte. Framed:
        also reads the frame header and raises :class:`FrameRejected` for a bad
        length, :class:`MessageTooSlow` or :class:`PeerClosed` if it does not come.
        """
        if self._start >= len(self._buffer):
            self.idle = True
            self._set_timeout(self._limits.idle_timeout_ms / 1000.0)
            self.waiting_idle = True
            try:
                self._buffer, self._start = self._sock.recv(READ_BYTES), 0
            finally:
                self.waiting_idle = False
            if not self._buffer:
                return False
        self.idle = False
        # The machine's clock, not the service's: the socket's timeouts bound the frame,
        # and the kernel counts them in real time.
        self._deadline = SYSTEM_CLOCK.monotonic() + self._limits.frame_timeout_ms / 1000.0
        self._begin()
        return True

    def read_message(self) -> TProtocolBase:
        """Receive the rest of the message, check it, and return a protocol positioned at it.

        Decode it at once: the protocol may be shared and is only valid until
        the next greenlet switch. Raises :class:`MessageRejected` subclasses,
        :class:`PeerClosed`.
        """
        return self.decode(self._receive())

    def receive(self) -> Any:
        """Receive the rest of the message, within the frame limit; its bytes, valid until
        the next :meth:`next_message`. :meth:`decode` checks them and turns them into a
        protocol; a message answered from its header alone needs no more than its length
        bounded (:mod:`service.overload.gate`)."""
        return self._receive()

    def decode(self, message: Any) -> TProtocolBase:
        """A protocol positioned at ``message`` (from :meth:`receive`), once the wire scan
        has checked it (:class:`MessageRejected` if it fails); decode it at once."""
        self._check(message)
        return self._decode(message)

    @property
    def input(self) -> TCyBufferedTransport:
        """The message as a hard-ended thriftpy2 transport, for a protocol of the caller's
        choice (:meth:`read_message` receives and checks it first). Read it at once."""
        message = self._receive()
        self._check(message)
        self._codec.bind(message)
        return self._codec.input

    @property
    def holdable(self) -> bool:
        """True if the connection can be served from the hub's callbacks for a while
        (:mod:`service.overload.held_connections`): framed, not TLS, and nothing buffered."""
        return False

    def push_back(self, data: bytes) -> None:
        """Put ``data``, read from the socket by someone else, before anything unread:
        the next :meth:`next_message` starts with it. Only while nothing is buffered."""
        if self._start < len(self._buffer):
            raise RuntimeError("push_back with bytes still buffered")
        self._buffer, self._start = data, 0

    def unread(self) -> bytes:
        """Bytes received and not yet handed out: between messages, the start of the next
        one (a pipelined call), which goes with the connection when it moves."""
        return bytes(memoryview(self._buffer)[self._start :])

    def framed(self, payload: bytes) -> bytes:
        """``payload`` as it goes on the wire (with its frame header where there are frames)."""
        return payload

    def send(self, payload: bytes) -> None:
        """Send ``payload``; raises :class:`ReplyNotTaken` if the peer has not taken it
        within ``frame_timeout_ms``."""
        self.send_framed(self.framed(payload))

    def send_framed(self, payload: bytes) -> None:
        """Send bytes already :meth:`framed` (or what is left of them), as :meth:`send`."""
        self._set_timeout(self._limits.frame_timeout_ms / 1000.0)
        try:
            # A reply fits the socket's buffer nearly always: one send() then, where
            # gevent's sendall() costs a getsockopt() and its own bookkeeping besides.
            sent = self._sock.send(payload)
            if sent < len(payload):
                self._sock.sendall(memoryview(payload)[sent:])
        except TimeoutError:
            raise ReplyNotTaken(
                f"reply of {len(payload)} bytes not taken within {self._limits.frame_timeout_ms} ms"
            ) from None

    def _begin(self) -> None:
        """Start on a message whose first bytes are buffered."""

    def _receive(self) -> Any:
        raise NotImplementedError

    def _check(self, message: Any) -> None:
        """Raise :class:`MessageRejected` unless ``message`` passes the wire scan."""

    def _set_timeout(self, timeout_s: float) -> None:
        if timeout_s != self._timeout:
            self._sock.settimeout(timeout_s)
            self._timeout = timeout_s

    def _time_left(self) -> float:
        """Seconds left for the message; raises :class:`MessageTooSlow` when none are."""
        left = self._deadline - SYSTEM_CLOCK.monotonic()
        if left <= 0:
            raise self._too_slow()
        return left

    def _too_slow(self) -> MessageTooSlow:
        return MessageTooSlow(
            f"message not complete within {self._limits.frame_timeout_ms} ms of its first byte"
        )

    def _recv_more(self, size: int) -> bytes:
        """Up to ``size`` more bytes of the current message, within its deadline."""
        self._set_timeout(self._time_left())
        try:
            data = self._sock.recv(size)
        except TimeoutError:
            raise self._too_slow() from None
        if not data:
            raise PeerClosed("connection closed inside a message")
        return data


class FramedChannel(SocketChannel):
    """Length-prefixed frames: ``[i32 length][length bytes]``, in both directions.

    The length is checked against ``max_frame_bytes`` before the body is read.
    A frame that arrived with its header is checked in place; a longer one is
    gathered as it arrives. ``limits`` may be just the frame limit (an int).
    """

    __slots__ = ("_length",)

    @property
    def holdable(self) -> bool:
        return self._start >= len(self._buffer) and not isinstance(self._sock, _TLS_SOCKETS)

    def framed(self, payload: bytes) -> bytes:
        return _FRAME_HEADER.pack(len(payload)) + payload

    def _begin(self) -> None:
        """Read the frame header; raises :class:`FrameRejected` for a bad length."""
        while len(self._buffer) - self._start < _FRAME_HEADER.size:
            more = self._recv_more(READ_BYTES)
            self._buffer, self._start = bytes(self._buffer[self._start :]) + more, 0
        (length,) = _FRAME_HEADER.unpack_from(self._buffer, self._start)
        limit = self._limits.max_frame_bytes
        if length < 0 or length > limit:
            raise FrameRejected(length, limit)
        self._start += _FRAME_HEADER.size
        self._length = length

    def _receive(self) -> Any:
        start, length = self._start, self._length
        buffered = len(self._buffer) - start
        frame: memoryview | bytearray
        if buffered >= length:
            frame = memoryview(self._buffer)[start : start + length]
            self._start = start + length
        else:
            # Grown as bytes arrive, never to the claimed length up front: a peer that
            # claims a large frame and sends little costs what it sent.
            frame = bytearray(self._buffer[start:])
            self._buffer, self._start = b"", 0
            while len(frame) < length:
                frame += self._recv_more(min(READ_BYTES, length - len(frame)))
        if self._start >= len(self._buffer):
            self._buffer, self._start = b"", 0  # hold nothing while idle
        return frame

    def _check(self, message: Any) -> None:
        check_frame(message, self._limits)
