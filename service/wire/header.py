"""The header of a checked call message: its method name and seqid, without decoding it.

For refusing a call unread (:mod:`service.overload.gate`): a few bytes read, where the
decoder would build the whole argument struct. The message is only bounded by the
frame limit (the wire scan is for messages that are decoded), so every length read
here is checked against the message's end.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["call_header"]

_CALL = 1
_I32 = struct.Struct("!i")
_STRICT_VERSION = 0x80010000 - (1 << 32)  # as a signed i32
_VERSION_MASK = 0xFFFF0000 - (1 << 32)
_COMPACT_ID = 0x82
_COMPACT_VERSION = 1


def call_header(message: Any, protocol: str) -> tuple[str, int] | None:
    """``(method name, seqid)`` of a CALL message, or None for anything else or a bad header."""
    try:
        if protocol == "compact":
            return _compact(message)
        return _binary(message)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError):
        return None


def _binary(message: Any) -> tuple[str, int] | None:
    (first,) = _I32.unpack_from(message, 0)
    if first < 0:  # strict: version and type, then the name, then the seqid
        if first & _VERSION_MASK != _STRICT_VERSION or first & 0xFF != _CALL:
            return None
        name, offset = _binary_name(message, 4)
        (seqid,) = _I32.unpack_from(message, offset)
        return name, seqid
    name, offset = _binary_name(message, 0)  # old style: the name, the type byte, the seqid
    if message[offset] != _CALL:
        return None
    (seqid,) = _I32.unpack_from(message, offset + 1)
    return name, seqid


def _binary_name(message: Any, offset: int) -> tuple[str, int]:
    (size,) = _I32.unpack_from(message, offset)
    start = offset + 4
    if size < 0 or start + size > len(message):
        raise ValueError("name past the end")
    return bytes(message[start : start + size]).decode("utf-8"), start + size


def _compact(message: Any) -> tuple[str, int] | None:
    if message[0] != _COMPACT_ID or message[1] & 0x1F != _COMPACT_VERSION:
        return None
    if message[1] >> 5 != _CALL:
        return None
    seqid, offset = _varint(message, 2)
    size, start = _varint(message, offset)
    if start + size > len(message):
        raise ValueError("name past the end")
    return bytes(message[start : start + size]).decode("utf-8"), _signed32(seqid)


def _varint(message: Any, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = message[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift > 35:
            raise ValueError("varint too long")


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value
