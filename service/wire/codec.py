"""Decoding a received, checked message, and the buffer replies are encoded into.

Binary messages are decoded by thriftpy2's Cython protocol, which needs a
Cython transport: a ``TCyBufferedTransport`` over a source that hands out the
message's bytes and then ``b''``, so a read it cannot satisfy raises
``TTransportException(END_OF_FILE)``. Compact messages are decoded by the
pure-Python protocol over :class:`_BoundedReader`, which refuses any read past
the message before allocating it (``TCyBufferedTransport`` would first allocate
whatever length a lying message claims). The Cython ``TCyMemoryBuffer`` never
holds input: it silently shortens reads, and the binary decoder then returns
uninitialised memory as the missing bytes.

One gevent hub runs one greenlet at a time, and decoding a message, or
encoding a reply and taking its bytes, involves no switch, so every
connection of a hub shares one decoding transport and one output buffer
(:class:`HubCodec`): an idle connection holds no buffer at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import gevent
from thriftpy2.protocol.base import TProtocolBase
from thriftpy2.protocol.compact import TCompactProtocol
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.transport import TTransportException
from thriftpy2.transport.buffered import TCyBufferedTransport
from thriftpy2.transport.memory import TCyMemoryBuffer

__all__ = ["HubCodec", "hub_codec", "decoder_for"]


class _MessageSource:
    """Hands out one message's bytes, then ``b''``: the end the decoder cannot pass."""

    __slots__ = ("_view", "_position")

    def __init__(self) -> None:
        self._view = memoryview(b"")
        self._position = 0

    def reset(self, message: Any) -> None:
        self._view = memoryview(message)
        self._position = 0

    def read(self, size: int) -> bytes:
        start = self._position
        end = min(start + max(size, 0), len(self._view))
        self._position = end
        return self._view[start:end].tobytes()


class _BoundedReader:
    """A compact decoder's input: refuses, before allocating, any read past the message."""

    __slots__ = ("_data", "_position")

    def __init__(self, message: Any) -> None:
        self._data = bytes(message)
        self._position = 0

    def read(self, size: int) -> bytes:
        start = self._position
        end = start + size
        if size < 0 or end > len(self._data):
            raise TTransportException(
                TTransportException.END_OF_FILE, f"read of {size} bytes past the end of the message"
            )
        self._position = end
        return self._data[start:end]


class HubCodec:
    """The decoding transport and the reply buffer shared by every connection of one hub.

    Use each without a greenlet switch from start to end: bind a message and
    decode it; clean :attr:`output`, encode a reply and take ``getvalue()``.
    """

    __slots__ = ("_source", "input", "_binary", "output", "__weakref__")

    def __init__(self) -> None:
        self._source = _MessageSource()
        #: The bound message as a hard-ended thriftpy2 transport.
        self.input = TCyBufferedTransport(self._source)
        # Not strict: old-style messages reach the decoder only when the scan let them
        # through (server.strict_binary = false); replies are always written strict.
        self._binary = TCyBinaryProtocol(self.input, strict_read=False)
        self.output = TCyMemoryBuffer()

    def bind(self, message: Any) -> TCyBinaryProtocol:
        """The binary protocol, positioned at the start of ``message``."""
        self._source.reset(message)
        self.input.clean()  # drop anything a previous, failed decode left behind
        return self._binary


_codecs: weakref.WeakKeyDictionary[Any, HubCodec] = weakref.WeakKeyDictionary()


def hub_codec() -> HubCodec:
    """The current gevent hub's (one per thread) :class:`HubCodec`."""
    hub = gevent.get_hub()
    codec = _codecs.get(hub)
    if codec is None:
        codec = _codecs[hub] = HubCodec()
    return codec


def decoder_for(protocol: str, codec: HubCodec) -> Callable[[Any], TProtocolBase]:
    """A function turning one checked message into a protocol positioned at its start.

    Raises ValueError for a protocol other than "binary" or "compact".
    """
    if protocol == "binary":
        return codec.bind
    if protocol == "compact":
        return _compact_protocol
    raise ValueError(f"unknown protocol {protocol!r}; expected binary or compact")


def _compact_protocol(message: Any) -> TProtocolBase:
    # A fresh protocol per message: TCompactProtocol keeps per-struct state that a
    # failed decode would leave behind.
    return TCompactProtocol(_BoundedReader(message))
