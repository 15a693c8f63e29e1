"""Checks a Thrift message's structure and every size it claims, before anything decodes it.

thriftpy2's decoders trust the message. The Cython binary decoder allocates a
claimed string length before reading a byte of it; both decoders skip fields
and container elements of an unknown type without consuming anything, so a
list claiming two billion such elements spins; the compact decoder has no
nesting limit at all. So before a decoder sees a message, :class:`MessageScan`
walks all of it (header, every field of every struct including unknown ones,
every string, every container) and accepts it only if:

* every string or binary is at most ``max_string_bytes`` long and fits in what
  is left of the message;
* every container holds at most ``max_container_items`` items, and that many of
  its smallest possible element (1 byte; 4 for a binary string, 8 for a
  double, ...) fit in what is left of the message;
* structs and containers nest at most ``max_nesting_depth`` deep, the
  argument struct counting as 1;
* every type code is a value type of the protocol, the message is a CALL or
  ONEWAY, and every varint has a legal length.

The walk follows the wire types, as both decoders do when they skip, so what
it checked is what they read. Strict binary messages start with 0x80, compact
ones with 0x82, old-style (non-strict) binary ones with 0x00, the top byte of
their name's length; the scan recognises each (the last unless
``server.strict_binary``) (:mod:`service.wire.binary`,
:mod:`service.wire.compact`), and the configured decoder then refuses the
other. The walk is resumable, so the unframed transport can check a message as
its bytes arrive and learn exactly where it ends.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NoReturn

from service.wire import binary, compact
from service.wire.errors import FrameRejected, LimitExceeded, MalformedMessage
from service.wire.walk import CALL, STRUCT

__all__ = ["WireLimits", "MessageScan", "check_frame"]

_WALKERS = {0x80: binary, 0x82: compact}
_I32 = struct.Struct("!i").unpack_from


@dataclass(frozen=True)
class WireLimits:
    """What one connection may send: sizes checked before allocating, and time bounds."""

    max_frame_bytes: int = 1024 * 1024
    max_string_bytes: int = 64 * 1024
    max_container_items: int = 10_000
    max_nesting_depth: int = 32
    idle_timeout_ms: int = 60_000  # between messages
    frame_timeout_ms: int = 5_000  # from a message's first byte to its last; also for a reply
    strict_binary: bool = False  # refuse old-style binary messages (no version header)


def check_frame(frame: Any, limits: WireLimits) -> None:
    """Check that ``frame`` (bytes-like) holds exactly one acceptable message.

    Raises :class:`MalformedMessage` or :class:`LimitExceeded` saying why not.
    """
    size = len(frame)
    if _is_call_without_arguments(frame, size, limits):
        return
    end = MessageScan(limits, framed=True).advance(frame, size, size)
    if end is None:  # a framed scan raises rather than wait for more, unless given nothing
        raise MalformedMessage("empty frame")
    if end != size:
        raise MalformedMessage(f"{size - end} bytes after the end of the message in its frame")


class MessageScan:
    """One message, walked as its bytes become available.

    ``framed``: the limit given to :meth:`advance` is the end of the frame, so
    a claim past it is a lie (:class:`MalformedMessage`); otherwise it is the
    size limit of an unframed message (:class:`FrameRejected`).
    """

    __slots__ = ("limits", "max_string_bytes", "_framed", "_pos", "_stack", "_protocol")

    def __init__(self, limits: WireLimits, start: int = 0, *, framed: bool) -> None:
        self.limits = limits
        self.max_string_bytes = limits.max_string_bytes
        self._framed = framed
        self._pos = start
        self._stack: list[list[int]] | None = None  # None until the header is read
        self._protocol: Any = None  # wire_binary or wire_compact, from the first byte

    def shift(self, offset: int) -> None:
        """The buffer lost its first ``offset`` bytes (all before the message)."""
        self._pos -= offset

    def advance(self, buf: Any, end: int, limit: int) -> int | None:
        """Walk ``buf`` up to ``end``; the message may not extend past ``limit``.

        Returns the offset just past the message once it is complete, None while
        it needs bytes beyond ``end``. Raises :class:`MalformedMessage` or
        :class:`LimitExceeded` (:class:`FrameRejected` past ``limit`` unframed).
        """
        if self._stack is None:
            if self._protocol is None:
                if self._pos >= end:
                    return None
                self._protocol = _protocol_of(buf[self._pos], self.limits.strict_binary)
            header_end = self._protocol.read_header(buf, self._pos, end, limit, self)
            if header_end is None:
                return None
            self._pos, self._stack = header_end, [[STRUCT]]  # the argument struct
        self._pos = self._protocol.walk(buf, self._pos, end, limit, self._stack, self)
        return None if self._stack else self._pos

    # The checks the walkers call (service.wire.walk.Checks); each raises or returns quietly.

    def overrun(self, token: int, limit: int) -> NoReturn:
        if self._framed:
            raise MalformedMessage(
                f"the value at byte {token} claims more bytes than its frame "
                f"holds ({limit - token} left)"
            )
        raise FrameRejected(None, self.limits.max_frame_bytes)

    def check_string(self, size: int, left: int) -> None:
        if size < 0:
            raise MalformedMessage(f"negative string length {size}")
        if size > self.limits.max_string_bytes:
            raise LimitExceeded(
                f"string of {size} bytes; the limit is "
                f"{self.limits.max_string_bytes} (server.max_string_bytes)"
            )
        if size > left:
            self._claims_past_end(f"string of {size} bytes", left)

    def check_items(self, count: int, smallest: int, left: int) -> None:
        """``count`` items of at least ``smallest`` bytes each must fit in ``left``."""
        if count < 0:
            raise MalformedMessage(f"negative container size {count}")
        if count > self.limits.max_container_items:
            raise LimitExceeded(
                f"container of {count} items; the limit is "
                f"{self.limits.max_container_items} (server.max_container_items)"
            )
        if count * smallest > left:
            self._claims_past_end(f"container of {count} items", left)

    def check_depth(self, depth: int) -> None:
        if depth >= self.limits.max_nesting_depth:
            raise LimitExceeded(
                f"structs and containers nested more than "
                f"{self.limits.max_nesting_depth} deep (server.max_nesting_depth)"
            )

    def _claims_past_end(self, what: str, left: int) -> NoReturn:
        if self._framed:
            raise MalformedMessage(f"{what} claims more than the {left} bytes left in its frame")
        raise FrameRejected(None, self.limits.max_frame_bytes)


def _is_call_without_arguments(frame: Any, size: int, limits: WireLimits) -> bool:
    """The commonest frame (ping, panels, health: a binary CALL with an empty argument
    struct), recognised in a few operations: header, name, seqid, STOP and nothing else."""
    return (
        13 <= size <= 13 + limits.max_string_bytes
        and frame[0] == 0x80
        and frame[1] == 0x01
        and frame[3] == CALL
        and frame[size - 1] == 0
        and _I32(frame, 4)[0] == size - 13
    )


def _protocol_of(first_byte: int, strict_binary: bool) -> Any:
    walker = _WALKERS.get(first_byte)
    if walker is not None:
        return walker
    if first_byte == 0x00:
        if not strict_binary:
            return binary.OLD_STYLE
        raise MalformedMessage(
            "old-style binary message without a version header; this server "
            "has server.strict_binary = true"
        )
    raise MalformedMessage(
        f"not a Thrift message: first byte 0x{first_byte:02x} "
        "(binary starts 0x80, or 0x00 old-style; compact 0x82)"
    )
