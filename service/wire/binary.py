"""Walks a binary Thrift message for :class:`service.wire.scan.MessageScan`.

Strict messages begin ``0x80 0x01``; old-style (non-strict) ones, which
Apache Thrift's own servers accept by default, begin with the name's i32 length
and carry the message type as one byte after the name (:func:`read_old_header`).
Only the header differs: the arguments are walked the same way.

Binary encoding: big-endian fixed-width numbers; strings as an i32 length and
the bytes; a struct as ``type, i16 id, value`` per field and a 0 (STOP) byte;
lists and sets as ``element type, i32 count`` and the elements; maps as
``key type, value type, i32 count`` and the pairs. See :mod:`service.wire.walk`
for the stack and the return convention.
"""

from __future__ import annotations

import struct
from typing import Any

from service.wire.errors import MalformedMessage
from service.wire.walk import CALL, LIST, MAP, ONEWAY, STRUCT, Checks, bad_message_type, bad_type

__all__ = ["read_header", "read_old_header", "walk", "OLD_STYLE"]

_I32 = struct.Struct("!i").unpack_from
_STRING, _STRUCT_TYPE, _MAP_TYPE, _SET_TYPE, _LIST_TYPE = 11, 12, 13, 14, 15
# bool, byte, double, i16, i32, i64
_FIXED = {2: 1, 3: 1, 4: 8, 6: 2, 8: 4, 10: 8}
# The smallest encoding of each value type: a string's length, a struct's STOP, container headers.
_SMALLEST = {**_FIXED, _STRING: 4, _STRUCT_TYPE: 1, _MAP_TYPE: 6, _SET_TYPE: 5, _LIST_TYPE: 5}


def read_header(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> int | None:
    """``0x80 0x01 ?? type``, i32 name length, name, i32 seqid: the offset after it
    (None until all of it is here)."""
    if pos + 12 > limit:  # even with an empty name
        scan.overrun(pos, limit)
    if pos + 8 > end:
        return None
    if buf[pos + 1] != 0x01:
        raise MalformedMessage(f"binary protocol version 0x80{buf[pos + 1]:02x}, expected 0x8001")
    if buf[pos + 3] not in (CALL, ONEWAY):
        raise bad_message_type(buf[pos + 3])
    size = _I32(buf, pos + 4)[0]
    scan.check_string(size, limit - pos - 12)
    after = pos + 12 + size
    return after if after <= end else None


def read_old_header(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> int | None:
    """i32 name length, name, message type byte, i32 seqid: the offset after it (None until
    all of it is here). The scan recognises such a message by its first byte, 0x00."""
    if pos + 9 > limit:  # even with an empty name
        scan.overrun(pos, limit)
    if pos + 4 > end:
        return None
    size = _I32(buf, pos)[0]
    scan.check_string(size, limit - pos - 9)
    type_at = pos + 4 + size
    if type_at >= end:
        return None
    if buf[type_at] not in (CALL, ONEWAY):
        raise bad_message_type(buf[type_at])
    after = type_at + 5
    return after if after <= end else None


def walk(buf: Any, pos: int, end: int, limit: int, stack: list[Any], scan: Checks) -> int:
    """Walk values from ``pos`` until the stack empties or the bytes (up to ``end``) run out."""
    fixed = _FIXED
    while stack:
        frame = stack[-1]
        token = pos
        kind = frame[0]
        if kind == STRUCT:
            if pos >= end:
                if pos >= limit:
                    scan.overrun(token, limit)
                return token
            ttype = buf[pos]
            if ttype == 0:  # STOP
                stack.pop()
                pos += 1
                continue
            pos += 3  # type, i16 field id
        else:
            left = frame[-1]
            if not left:
                stack.pop()
                continue
            ttype = frame[2] if kind == MAP and left & 1 else frame[1]  # map: key, value, ...
        width = fixed.get(ttype)
        if width is not None:  # the common case, without a call
            pos, child = pos + width, None
        else:
            pos, child = _value(buf, pos, end, limit, ttype, scan)
        if pos > end:
            if pos > limit:
                scan.overrun(token, limit)
            return token
        if kind:
            frame[-1] -= 1
        if child is not None:
            scan.check_depth(len(stack))
            stack.append(child)
    return pos


def _value(
    buf: Any, pos: int, end: int, limit: int, ttype: int, scan: Checks
) -> tuple[int, list[int] | None]:
    """Skip one string or container header (offset > ``end`` if incomplete); the frame to
    push for a struct or for container items that must be walked one by one."""
    if ttype == _STRING:
        if pos + 4 > end:
            return pos + 4, None
        size = _I32(buf, pos)[0]
        if not 0 <= size <= scan.max_string_bytes or size > limit - pos - 4:
            scan.check_string(size, limit - pos - 4)  # raises
        return pos + 4 + size, None
    if ttype == _STRUCT_TYPE:
        return pos, [STRUCT]
    if ttype in (_LIST_TYPE, _SET_TYPE):
        return _list(buf, pos, end, limit, scan)
    if ttype == _MAP_TYPE:
        return _map(buf, pos, end, limit, scan)
    raise bad_type(ttype)


def _list(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> tuple[int, list[int] | None]:
    if pos + 5 > end:
        return pos + 5, None
    element, count = buf[pos], _I32(buf, pos + 1)[0]
    pos += 5
    if not count:
        return pos, None
    if element not in _SMALLEST:
        raise bad_type(element)
    scan.check_items(count, _SMALLEST[element], limit - pos)
    width = _FIXED.get(element)
    if width is not None:
        return pos + count * width, None
    if element == _STRING:
        pos, count = _strings(buf, pos, end, limit, count, scan)
    return pos, ([LIST, element, count] if count else None)


def _map(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> tuple[int, list[int] | None]:
    if pos + 6 > end:
        return pos + 6, None
    key, value, count = buf[pos], buf[pos + 1], _I32(buf, pos + 2)[0]
    pos += 6
    if not count:
        return pos, None
    for ttype in (key, value):
        if ttype not in _SMALLEST:
            raise bad_type(ttype)
    scan.check_items(count, _SMALLEST[key] + _SMALLEST[value], limit - pos)
    left = 2 * count
    if key == _STRING and value == _STRING:
        pos, left = _strings(buf, pos, end, limit, left, scan)
    return pos, ([MAP, key, value, left] if left else None)


def _strings(buf: Any, pos: int, end: int, limit: int, count: int, scan: Checks) -> tuple[int, int]:
    """Skip up to ``count`` consecutive strings (list<string>, map<string,string>) in one
    loop; returns the offset after them and how many are not wholly here yet."""
    max_string, unpack_i32 = scan.max_string_bytes, _I32
    while count and pos + 4 <= end:
        size = unpack_i32(buf, pos)[0]
        if not 0 <= size <= max_string or size > limit - pos - 4:
            scan.check_string(size, limit - pos - 4)  # raises
        if pos + 4 + size > end:
            break
        pos += 4 + size
        count -= 1
    return pos, count


class OLD_STYLE:
    """The walker of old-style (non-strict) binary messages: their own header, the same walk."""

    read_header = staticmethod(read_old_header)
    walk = staticmethod(walk)
