"""Bounded Thrift message input and output on one server connection.

A :class:`FramedChannel` reads one length-prefixed frame at a time: it checks
the declared length against the limit *before* allocating, reads exactly that
many bytes, and decodes from them alone. A :class:`BufferedChannel` has no
frames; it bounds each message by counting the bytes it reads for it.

Why the decoder never reads past its input: both channels feed the protocol
through thriftpy2's ``TCyBufferedTransport`` wrapped around a source that
hands out the available bytes and then ``b''``. That transport raises
``TTransportException(END_OF_FILE)`` when a read cannot be satisfied, so a
struct that claims more bytes than the frame holds fails to decode. (The
Cython ``TCyMemoryBuffer`` must not be used for input: it silently shortens
reads, and the binary decoder then returns bytes from outside the input.)

Errors, from the channel's point of view:

* :class:`FrameRejected` -- the peer declared a frame (or sent a message)
  larger than the limit, or a negative length; close the connection.
* :class:`OSError` (including ``TimeoutError`` and :class:`PeerClosed`) -- the
  connection itself failed, idled out, or the peer went away.
* anything else raised while decoding -- the message is malformed.
"""

from __future__ import annotations

import socket
import struct
from typing import Callable, Optional, Protocol

from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.protocol.compact import TCompactProtocol
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.transport.buffered import TCyBufferedTransport
from thriftpy2.transport.memory import TCyMemoryBuffer

__all__ = [
    "FrameRejected", "PeerClosed", "Channel", "FramedChannel", "BufferedChannel",
    "open_channel", "protocol_for", "new_output_buffer", "TRANSPORTS", "PROTOCOLS",
]

TRANSPORTS = ("framed", "buffered")
PROTOCOLS = ("binary", "compact")

_FRAME_HEADER = struct.Struct("!i")
# Per-connection receive buffer: typical calls arrive, header and body, in one read.
_READ_AHEAD_BYTES = 16 * 1024


class FrameRejected(Exception):
    """A frame or message is larger than the limit, or declares a negative length.

    Raised before the body is allocated or read; the connection must be closed
    because the stream can no longer be trusted to be in step.
    """

    def __init__(self, length: Optional[int], limit: int) -> None:
        if length is None:
            super().__init__(f"message longer than the {limit}-byte limit")
        else:
            super().__init__(f"frame length {length} outside 0..{limit} bytes")
        self.length = length
        self.limit = limit


class PeerClosed(ConnectionError):
    """The peer closed the connection (possibly in the middle of a message)."""


class Channel(Protocol):
    """One connection's message input (:attr:`input`) and reply output (:meth:`send`)."""

    input: TCyBufferedTransport
    #: True while waiting for the first byte of the next message: closing the
    #: connection then loses no call.
    idle: bool

    def next_message(self) -> bool: ...

    def send(self, payload: bytes) -> None: ...


def open_channel(transport: str, sock: socket.socket, max_message_bytes: int) -> Channel:
    """The channel for ``transport`` ("framed" or "buffered"); raises ValueError otherwise."""
    if transport == "framed":
        return FramedChannel(sock, max_message_bytes)
    if transport == "buffered":
        return BufferedChannel(sock, max_message_bytes)
    raise ValueError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")


def protocol_for(protocol: str) -> Callable[[object], TProtocolBase]:
    """A factory building the ``protocol`` ("binary" or "compact") over a transport.

    Raises ValueError for any other name.
    """
    if protocol == "binary":
        return TCyBinaryProtocol
    if protocol == "compact":
        return TCompactProtocol
    raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")


def new_output_buffer() -> TCyMemoryBuffer:
    """A reusable buffer for encoding replies (writing to it is safe; see the module doc)."""
    return TCyMemoryBuffer()


class _FrameSource:
    """Hands out one frame's bytes, then ``b''``: the end the decoder cannot pass."""

    __slots__ = ("_view", "_position")

    def __init__(self) -> None:
        self._view = memoryview(b"")
        self._position = 0

    def reset(self, frame: memoryview | bytearray) -> None:
        self._view = memoryview(frame)
        self._position = 0

    def read(self, size: int) -> bytes:
        start = self._position
        end = min(start + max(size, 0), len(self._view))
        self._position = end
        return self._view[start:end].tobytes()


class FramedChannel:
    """Length-prefixed frames: ``[i32 length][length bytes]``, in both directions.

    Frames that fit the read-ahead buffer are received with as few reads as the
    network allows (header and body together) and decoded in place; larger
    ones get their own buffer, allocated once the length has been checked.
    """

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self._sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray(_READ_AHEAD_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0  # first byte not yet handed out
        self._end = 0    # one past the last byte received
        self._source = _FrameSource()
        self.input = TCyBufferedTransport(self._source)
        self.idle = True

    def next_message(self) -> bool:
        """Read the next frame; False if the peer closed cleanly before it began.

        Raises :class:`FrameRejected` for a bad length, :class:`PeerClosed`
        when the stream ends inside a frame, ``TimeoutError`` when the socket
        idles out.
        """
        self.idle = self._start == self._end
        if not self._fill(_FRAME_HEADER.size, at_message_start=True):
            return False
        (length,) = _FRAME_HEADER.unpack_from(self._buffer, self._start)
        if length < 0 or length > self._max_frame_bytes:
            raise FrameRejected(length, self._max_frame_bytes)
        self._start += _FRAME_HEADER.size
        self._source.reset(self._take(length))
        self.input.clean()  # drop anything a previous, malformed decode left behind
        return True

    def send(self, payload: bytes) -> None:
        self._sock.sendall(_FRAME_HEADER.pack(len(payload)) + payload)

    def _fill(self, wanted: int, at_message_start: bool = False) -> bool:
        """Have at least ``wanted`` (<= buffer size) unread bytes in the buffer.

        False only if the stream ended cleanly at a message boundary.
        """
        if self._end - self._start >= wanted:
            return True
        if len(self._buffer) - self._start < wanted:  # make room at the end
            unread = self._end - self._start
            self._buffer[:unread] = self._buffer[self._start:self._end]
            self._start, self._end = 0, unread
        while self._end - self._start < wanted:  # each pass receives at least one byte or ends
            received = self._sock.recv_into(self._view[self._end:])
            if received == 0:
                if at_message_start and self._end == self._start:
                    return False
                raise PeerClosed("connection closed inside a frame")
            self._end += received
            self.idle = False
        return True

    def _take(self, length: int) -> memoryview | bytearray:
        """The next ``length`` bytes: a view of the buffer, or a new buffer if too big."""
        if length <= len(self._buffer):
            self._fill(length)
            frame = self._view[self._start:self._start + length]
            self._start += length
            return frame
        frame = bytearray(length)
        unread = self._end - self._start
        frame[:unread] = self._view[self._start:self._end]
        self._start = self._end = 0
        _recv_exactly(self._sock, memoryview(frame)[unread:])
        return frame


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raises :class:`PeerClosed` if the stream ends first."""
    filled = 0
    while filled < len(view):  # each pass receives at least one byte or raises
        received = sock.recv_into(view[filled:])
        if received == 0:
            raise PeerClosed(f"connection closed after {filled} of {len(view)} bytes")
        filled += received


class _SocketSource:
    """Reads from the socket for the decoder, at most ``budget`` bytes per message."""

    __slots__ = ("_sock", "_channel", "_max_message_bytes", "_budget")

    def __init__(self, sock: socket.socket, channel: "BufferedChannel", max_message_bytes: int) -> None:
        self._sock = sock
        self._channel = channel
        self._max_message_bytes = max_message_bytes
        self._budget = max_message_bytes

    def start_message(self) -> None:
        self._budget = self._max_message_bytes

    def read(self, size: int) -> bytes:
        allowed = min(size, self._budget)
        if allowed <= 0:
            raise FrameRejected(None, self._max_message_bytes)
        data = self._sock.recv(allowed)
        if not data:
            raise PeerClosed("connection closed by peer")
        self._budget -= len(data)
        self._channel.idle = False
        return data


class BufferedChannel:
    """Unframed messages, read straight from the socket through a read buffer.

    The byte budget counts what is read from the socket while decoding one
    message, read-ahead included, so the limit is approximate (never looser
    than one buffer's worth).
    """

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self._sock = sock
        self._source = _SocketSource(sock, self, max_message_bytes)
        self.input = TCyBufferedTransport(self._source)
        self.idle = True

    def next_message(self) -> bool:
        """Prepare for the next message; the end of the stream surfaces as :class:`PeerClosed`."""
        self.idle = True
        self._source.start_message()
        return True

    def send(self, payload: bytes) -> None:
        self._sock.sendall(payload)
