"""Opening the channel a transport names, the unframed channel, and what encodes replies.

:func:`open_channel` gives a connection its :class:`~service.wire.channel.FramedChannel`
or :class:`BufferedChannel`; :func:`protocol_for` the protocol its replies are
encoded with; :func:`shared_output_buffer` the hub's buffer they are encoded into.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.protocol.compact import TCompactProtocol
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.transport.memory import TCyMemoryBuffer

from service.wire.channel import READ_BYTES, Channel, FramedChannel, SocketChannel
from service.wire.codec import hub_codec
from service.wire.formats import PROTOCOLS, TRANSPORTS
from service.wire.scan import MessageScan, WireLimits

__all__ = ["BufferedChannel", "open_channel", "protocol_for", "shared_output_buffer"]


def open_channel(
    transport: str, sock: socket.socket, limits: WireLimits, protocol: str = "binary"
) -> Channel:
    """The channel for ``transport`` ("framed" or "buffered"); raises ValueError otherwise."""
    if transport == "framed":
        return FramedChannel(sock, limits, protocol)
    if transport == "buffered":
        return BufferedChannel(sock, limits, protocol)
    raise ValueError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")


def protocol_for(protocol: str) -> Callable[[Any], TProtocolBase]:
    """A factory building the ``protocol`` ("binary" or "compact") over a transport.

    Raises ValueError for any other name.
    """
    factories: dict[str, Callable[[Any], Any]] = {
        "binary": TCyBinaryProtocol,
        "compact": TCompactProtocol,
    }
    if protocol in factories:
        return factories[protocol]
    raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")


def shared_output_buffer() -> TCyMemoryBuffer:
    """This hub's reply buffer: clean it, encode, and take ``getvalue()`` with no switch between."""
    return hub_codec().output


class BufferedChannel(SocketChannel):
    """Unframed messages, each scanned as it arrives, at most ``max_frame_bytes`` long.

    The scan knows where a message ends, so bytes after it stay for the next one.
    """

    __slots__ = ()

    def _check(self, message: Any) -> None:
        """Nothing more: :meth:`_receive` scanned the message to find where it ends."""

    def _receive(self) -> Any:
        buf, start = self._buffer, self._start
        limit = start + self._limits.max_frame_bytes
        scan = MessageScan(self._limits, start, framed=False)
        end = scan.advance(buf, min(len(buf), limit), limit)
        while end is None:
            if start:  # keep only this message's bytes before growing the buffer
                buf = bytearray(memoryview(buf)[start:])
                scan.shift(start)
                limit -= start
                start = 0
            elif not isinstance(buf, bytearray):
                buf = bytearray(buf)
            buf += self._recv_more(min(READ_BYTES, limit - len(buf)))
            self._buffer, self._start = buf, start
            end = scan.advance(buf, min(len(buf), limit), limit)
        message = memoryview(buf)[start:end]
        self._buffer, self._start = (buf, end) if end < len(buf) else (b"", 0)
        return message
