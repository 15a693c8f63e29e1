"""The call header read without decoding (service.wire.header), on real encodings."""

from __future__ import annotations

import pytest
from thriftpy2.protocol import TBinaryProtocol, TCompactProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TMemoryBuffer

from service.idl import appstats
from service.wire.header import call_header


def _message(protocol_class: type, name: str, kind: int, seqid: int, **options: bool) -> bytes:
    buffer = TMemoryBuffer()
    protocol = protocol_class(buffer, **options)
    protocol.write_message_begin(name, kind, seqid)
    appstats.AppStats.get_app_stats_args(request=appstats.StatsRequest(app="shop")).write(protocol)
    protocol.write_message_end()
    return buffer.getvalue()


@pytest.mark.parametrize("seqid", [0, 7, 2**31 - 1, -5])
def test_the_name_and_seqid_of_a_call_in_each_encoding(seqid: int) -> None:
    for protocol, message in (
        ("binary", _message(TBinaryProtocol, "get_app_stats", TMessageType.CALL, seqid)),
        (
            "binary",
            _message(
                TBinaryProtocol, "get_app_stats", TMessageType.CALL, seqid, strict_write=False
            ),
        ),
        # As Apache Thrift writes it: the seqid's 32 bits, unsigned (thriftpy2's compact
        # writer never ends on a negative number).
        (
            "compact",
            _message(TCompactProtocol, "get_app_stats", TMessageType.CALL, seqid & 0xFFFFFFFF),
        ),
    ):
        assert call_header(message, protocol) == ("get_app_stats", seqid), protocol
        assert call_header(memoryview(message), protocol) == ("get_app_stats", seqid)


def test_anything_but_a_whole_call_header_is_none() -> None:
    reply = _message(TBinaryProtocol, "get_app_stats", TMessageType.REPLY, 1)
    compact_reply = _message(TCompactProtocol, "get_app_stats", TMessageType.REPLY, 1)
    call = _message(TBinaryProtocol, "get_app_stats", TMessageType.CALL, 1)
    assert call_header(reply, "binary") is None
    assert call_header(compact_reply, "compact") is None
    assert call_header(call[:10], "binary") is None  # the name cut short
    assert call_header(call[:4], "binary") is None
    assert call_header(b"", "binary") is None
    assert call_header(b"GET / HTTP/1.1\r\n", "binary") is None
    assert call_header(call, "compact") is None  # the wrong protocol
    assert call_header(b"\x82\x21\xff\xff\xff\xff\xff\xff", "compact") is None  # endless varint
