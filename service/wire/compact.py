"""Walks a compact-protocol Thrift message for :class:`service.wire.scan.MessageScan`.

Compact encoding: integers as (zigzag) varints; strings as a varint length and
the bytes; a struct field as one byte (id delta << 4 | type), a zigzag varint id
when the delta is 0, then the value, except a bool field whose value is its
type (1 true, 2 false); a 0 type nibble is STOP. Lists and sets start with
``size << 4 | element type`` (size 15: a varint size follows); maps with a
varint size and, when not empty, ``key type << 4 | value type``. See
:mod:`service.wire.walk` for the stack and the return convention.
"""

from __future__ import annotations

from typing import Any

from service.wire.errors import MalformedMessage
from service.wire.walk import CALL, LIST, MAP, ONEWAY, STRUCT, Checks, bad_message_type, bad_type

__all__ = ["read_header", "walk"]

_BOOL_FIELD = -1  # a bool struct field: no value bytes
_BINARY, _LIST_TYPE, _SET_TYPE, _MAP_TYPE, _STRUCT_TYPE = 8, 9, 10, 11, 12
# bool (as a container element: one byte, 1 or 2), byte, double
_FIXED = {1: 1, 2: 1, 3: 1, 7: 8}
# i16 and i32 as Apache reads them (varint32), i64
_VARINT_BYTES = {4: 5, 5: 5, 6: 10}
_VARINT32 = 5
# The smallest encoding of each value type as a container element.
_SMALLEST = {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 8, 8: 1, 9: 1, 10: 1, 11: 1, 12: 1}


def read_header(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> int | None:
    """``0x82``, version and type, varint seqid, varint name length, name: the offset
    after it (None until all of it is here)."""
    if pos + 2 > end:
        if pos + 2 > limit:
            scan.overrun(pos, limit)
        return None
    version_and_type = buf[pos + 1]
    if version_and_type & 0x1F != 1:
        raise MalformedMessage(f"compact protocol version {version_and_type & 0x1F}, expected 1")
    if version_and_type >> 5 not in (CALL, ONEWAY):
        raise bad_message_type(version_and_type >> 5)
    _, after = _varint(buf, pos + 2, end, _VARINT32)
    if after <= end:
        size, after = _varint(buf, after, end, _VARINT32)
        if after <= end:
            scan.check_string(size, limit - after)
            after += size
    if after > end:
        if end >= limit:
            scan.overrun(pos, limit)
        return None
    return after


def walk(buf: Any, pos: int, end: int, limit: int, stack: list[Any], scan: Checks) -> int:
    """Walk values from ``pos`` until the stack empties or the bytes (up to ``end``) run out."""
    while stack:
        frame = stack[-1]
        token = pos
        kind = frame[0]
        if kind == STRUCT:
            if pos >= end:
                if pos >= limit:
                    scan.overrun(token, limit)
                return token
            header = buf[pos]
            ttype = header & 0x0F
            if ttype == 0:  # STOP: thriftpy2 and Apache look at the type nibble only
                stack.pop()
                pos += 1
                continue
            pos += 1
            if header < 0x10:  # no id delta: a zigzag varint field id follows
                _, pos = _varint(buf, pos, end, _VARINT32)
            if ttype <= 2:
                ttype = _BOOL_FIELD
        else:
            left = frame[-1]
            if not left:
                stack.pop()
                continue
            ttype = frame[2] if kind == MAP and left & 1 else frame[1]  # map: key, value, ...
        pos, child = _value(buf, pos, end, limit, ttype, scan)
        if pos > end:
            if pos > limit or end >= limit:
                scan.overrun(token, limit)
            return token
        if kind:
            frame[-1] -= 1
        if child is not None:
            scan.check_depth(len(stack))
            stack.append(child)
    return pos


def _varint(buf: Any, pos: int, end: int, max_bytes: int) -> tuple[int, int]:
    """(value, offset after it); the offset is ``end + 1`` when the varint runs past ``end``.

    Raises :class:`MalformedMessage` for a varint longer than ``max_bytes``.
    """
    if pos < end and buf[pos] < 0x80:  # the common one-byte case
        return buf[pos], pos + 1
    result = shift = 0
    for offset in range(pos, min(pos + max_bytes, end)):
        byte = buf[offset]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, offset + 1
        shift += 7
    if pos + max_bytes <= end:
        raise MalformedMessage(f"varint longer than {max_bytes} bytes")
    return 0, end + 1


def _value(
    buf: Any, pos: int, end: int, limit: int, ttype: int, scan: Checks
) -> tuple[int, list[int] | None]:
    """Skip one value of ``ttype`` (offset > ``end`` if incomplete); the frame to push
    for a struct or for container items that must be walked one by one."""
    if pos > end or ttype == _BOOL_FIELD:
        return pos, None
    width = _FIXED.get(ttype)
    if width is not None:
        return pos + width, None
    if ttype in _VARINT_BYTES:
        return _varint(buf, pos, end, _VARINT_BYTES[ttype])[1], None
    if ttype == _BINARY:
        size, pos = _varint(buf, pos, end, _VARINT32)
        if pos <= end:
            scan.check_string(size, limit - pos)
            pos += size
        return pos, None
    if ttype == _STRUCT_TYPE:
        return pos, [STRUCT]
    if ttype in (_LIST_TYPE, _SET_TYPE):
        return _list(buf, pos, end, limit, scan)
    if ttype == _MAP_TYPE:
        return _map(buf, pos, end, limit, scan)
    raise bad_type(ttype)


def _list(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> tuple[int, list[int] | None]:
    if pos >= end:
        return end + 1, None
    element, count = buf[pos] & 0x0F, buf[pos] >> 4
    pos += 1
    if count == 15:
        count, pos = _varint(buf, pos, end, _VARINT32)
        if pos > end:
            return pos, None
    if not count:
        return pos, None
    if element not in _SMALLEST:
        raise bad_type(element)
    scan.check_items(count, _SMALLEST[element], limit - pos)
    width = _FIXED.get(element)
    if width is not None:
        return pos + count * width, None
    return pos, [LIST, element, count]


def _map(buf: Any, pos: int, end: int, limit: int, scan: Checks) -> tuple[int, list[int] | None]:
    count, pos = _varint(buf, pos, end, _VARINT32)
    if pos > end or not count:
        return pos, None
    if pos >= end:
        return end + 1, None
    key, value = buf[pos] >> 4, buf[pos] & 0x0F
    pos += 1
    for ttype in (key, value):
        if ttype not in _SMALLEST:
            raise bad_type(ttype)
    scan.check_items(count, _SMALLEST[key] + _SMALLEST[value], limit - pos)
    return pos, [MAP, key, value, 2 * count]
