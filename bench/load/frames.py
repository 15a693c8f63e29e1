"""Pre-encoded Thrift calls and a cheap reading of the replies, for the load generator.

A call is encoded once (framed transport, strict binary protocol) and the same
bytes are sent for every call: the load generator must not spend its CPU on
Thrift encoding. A reply is classified from its first bytes without decoding it:

    message type EXCEPTION            -> "app_exception" (TApplicationException)
    REPLY, result field 0 or void     -> "ok", or "degraded" when fewer than the
                                         expected outcomes say TaskStatus.OK
    REPLY, result field id n > 0      -> the declared exception's name ("overloaded", ...)
    anything else                     -> "bad_reply"

A reply whose panel pymongo failed because its monitor's check timed out carries
:data:`MONITOR_CUT_BYTES` in that panel's error; the load generator counts such replies.

Counting OK outcomes looks for the bytes of ``3: TaskStatus status = OK`` (field
header i32/id 3, value 0). Only TaskOutcome has an i32 field 3 in StatsResponse;
a string or double that happened to contain those seven bytes could only make a
degraded reply look complete, which text strings and the elapsed times of this
benchmark do not do.
"""

from __future__ import annotations

import struct
from typing import Any

from thriftpy2.protocol import TBinaryProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TMemoryBuffer

from lookups.backends.mongo_errors import MONITOR_CUT
from service.idl import appstats

__all__ = [
    "encode_call",
    "classify_reply",
    "exception_names",
    "decode_result",
    "ping_frame",
    "stats_frame",
    "OK_OUTCOME_BYTES",
    "MONITOR_CUT_BYTES",
]

#: Field header (type i32 = 8, id 3) and value 0 (TaskStatus.OK) of a TaskOutcome.
OK_OUTCOME_BYTES = b"\x08\x00\x03\x00\x00\x00\x00"
#: In the error of a panel that pymongo failed because its monitor's check timed out.
MONITOR_CUT_BYTES = MONITOR_CUT.encode()
_VERSION_MASK = 0xFFFF0000
_VERSION_1 = 0x80010000


def encode_call(method: str, args: Any, seqid: int = 0) -> bytes:
    """The framed, strict-binary bytes of one call of ``method`` with the ``*_args`` struct."""
    buffer = TMemoryBuffer()
    protocol = TBinaryProtocol(buffer)
    protocol.write_message_begin(method, TMessageType.CALL, seqid)
    args.write(protocol)
    protocol.write_message_end()
    body: bytes = buffer.getvalue()
    return struct.pack("!i", len(body)) + body


def ping_frame() -> bytes:
    return encode_call("ping", appstats.AppStats.ping_args())


def stats_frame(
    app: str,
    start_ms: int,
    end_ms: int,
    panels: list[str] | None = None,
    deadline_ms: int | None = None,
    criticality: str = "",
    caller: str = "",
) -> bytes:
    """A get_app_stats call; without ``deadline_ms`` the server's default deadline applies,
    without ``criticality`` (a name: ``"SHEDDABLE"``) the server takes it as CRITICAL, and
    without ``caller`` (``RequestMeta.caller``) as the anonymous caller's."""
    level = getattr(appstats.Criticality, criticality) if criticality else None
    meta = (
        None
        if deadline_ms is None and level is None and not caller
        else appstats.RequestMeta(deadline_ms=deadline_ms, criticality=level, caller=caller or None)
    )
    request = appstats.StatsRequest(
        app=app, start_ms=start_ms, end_ms=end_ms, panels=panels, meta=meta
    )
    return encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(request=request))


def exception_names(method: str) -> dict[int, str]:
    """Result field id -> name of each exception ``method`` declares."""
    spec = getattr(appstats.AppStats, f"{method}_result").thrift_spec
    return {fid: entry[1] for fid, entry in spec.items() if fid != 0}


def _result_offset(body: bytes) -> tuple[int, int]:
    """(message type, offset of the result struct) of a binary-protocol message."""
    (first,) = struct.unpack_from("!i", body, 0)
    if first < 0:  # strict: version | type, name, seqid
        if (first & _VERSION_MASK) != _VERSION_1:
            raise ValueError("unknown protocol version")
        (name_len,) = struct.unpack_from("!i", body, 4)
        return first & 0xFF, 8 + name_len + 4
    name_len = first  # old non-strict: name, type, seqid
    return body[4 + name_len], 4 + name_len + 1 + 4


def classify_reply(
    body: bytes, expect_ok: int = 0, exceptions: dict[int, str] | None = None
) -> str:
    """Classify one reply message (without its frame header) as described in the module doc.

    ``expect_ok`` > 0 requires that many OK outcomes for "ok"; ``exceptions`` maps
    result field ids to names (unknown ids give "exception_<id>"). Never raises.
    """
    try:
        message_type, offset = _result_offset(body)
        if message_type == TMessageType.EXCEPTION:
            return "app_exception"
        if message_type != TMessageType.REPLY:
            return "bad_reply"
        if body[offset] == 0:  # STOP straight away: a void result
            return "ok"
        (field_id,) = struct.unpack_from("!h", body, offset + 1)
    except (struct.error, IndexError, ValueError):
        return "bad_reply"
    if field_id != 0:
        return (exceptions or {}).get(field_id, f"exception_{field_id}")
    if expect_ok and body.count(OK_OUTCOME_BYTES) < expect_ok:
        return "degraded"
    return "ok"


def decode_result(method: str, body: bytes) -> Any:
    """Fully decode a reply's result struct (for sampled inspection); raises on bad input."""
    buffer = TMemoryBuffer(body)
    protocol = TBinaryProtocol(buffer)
    protocol.read_message_begin()
    result = getattr(appstats.AppStats, f"{method}_result")()
    result.read(protocol)
    return result
