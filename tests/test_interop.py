"""Apache Thrift's own Python library talks to our server, with calls written by hand.

No code generation: messages are written field by field with Apache Thrift's
protocols and transports, and replies read back into plain ``{field id: value}``
dicts, for every transport x protocol pair the server offers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from thrift.protocol.TBinaryProtocol import TBinaryProtocol
from thrift.protocol.TCompactProtocol import TCompactProtocol
from thrift.Thrift import TApplicationException, TMessageType, TType
from thrift.transport.TSocket import TSocket
from thrift.transport.TTransport import TBufferedTransport, TFramedTransport, TTransportException

import thrift
from tests.support.server import COMBINATIONS

_REPO_ROOT = Path(__file__).resolve().parent.parent
_TRANSPORTS = {"framed": TFramedTransport, "buffered": TBufferedTransport}
_PROTOCOLS = {"binary": TBinaryProtocol, "compact": TCompactProtocol}
_MAX_FIELDS = 64  # more fields than any struct in the IDL: a bound on the read loop
_SCALAR_READERS = {
    TType.BOOL: "readBool",
    TType.BYTE: "readByte",
    TType.I16: "readI16",
    TType.I32: "readI32",
    TType.I64: "readI64",
    TType.DOUBLE: "readDouble",
    TType.STRING: "readString",
}

Reply = tuple[int, Any]


def read_value(proto: Any, ttype: int) -> Any:
    if ttype in _SCALAR_READERS:
        return getattr(proto, _SCALAR_READERS[ttype])()
    if ttype == TType.STRUCT:
        return read_struct(proto)
    if ttype in (TType.LIST, TType.SET):
        element_type, size = proto.readListBegin()
        values = [read_value(proto, element_type) for _ in range(size)]
        proto.readListEnd()
        return values
    if ttype == TType.MAP:
        key_type, value_type, size = proto.readMapBegin()
        mapping = {read_value(proto, key_type): read_value(proto, value_type) for _ in range(size)}
        proto.readMapEnd()
        return mapping
    raise AssertionError(f"unexpected type {ttype}")


def read_struct(proto: Any) -> dict[int, Any]:
    proto.readStructBegin()
    fields: dict[int, Any] = {}
    for _ in range(_MAX_FIELDS):
        _, field_type, field_id = proto.readFieldBegin()
        if field_type == TType.STOP:
            break
        fields[field_id] = read_value(proto, field_type)
        proto.readFieldEnd()
    proto.readStructEnd()
    return fields


def call(
    server: Any,
    transport: str,
    protocol: str,
    method: str,
    write_args: Callable[[Any], None],
    *,
    strict: bool = True,
) -> Reply:
    """Send one call; return (message type, result fields or the TApplicationException).

    ``strict=False``: old-style binary, as legacy Apache Thrift clients write it.
    """
    sock = TSocket(*server.address)
    sock.setTimeout(5000)
    trans = _TRANSPORTS[transport](sock)
    proto = (
        _PROTOCOLS[protocol](trans)
        if strict
        else TBinaryProtocol(trans, strictRead=False, strictWrite=False)
    )
    trans.open()
    try:
        proto.writeMessageBegin(method, TMessageType.CALL, 41)
        proto.writeStructBegin(f"{method}_args")
        write_args(proto)
        proto.writeFieldStop()
        proto.writeStructEnd()
        proto.writeMessageEnd()
        trans.flush()

        name, message_type, seqid = proto.readMessageBegin()
        assert (name, seqid) == (method, 41)
        if message_type == TMessageType.EXCEPTION:
            error = TApplicationException()
            error.read(proto)
            return message_type, error
        result = read_struct(proto)
        proto.readMessageEnd()
        return message_type, result
    finally:
        trans.close()


def no_args(proto: Any) -> None:
    """ping() and panels() take no arguments."""


def stats_request(app: str) -> Callable[[Any], None]:
    def write(proto: Any) -> None:
        proto.writeFieldBegin("request", TType.STRUCT, 1)
        proto.writeStructBegin("StatsRequest")
        proto.writeFieldBegin("app", TType.STRING, 1)
        proto.writeString(app)
        proto.writeFieldEnd()
        proto.writeFieldBegin("start_ms", TType.I64, 2)
        proto.writeI64(1_000)
        proto.writeFieldEnd()
        proto.writeFieldBegin("end_ms", TType.I64, 3)
        proto.writeI64(2_000)
        proto.writeFieldEnd()
        proto.writeFieldBegin("panels", TType.LIST, 4)
        proto.writeListBegin(TType.STRING, 2)
        proto.writeString("errors")
        proto.writeString("latency")
        proto.writeListEnd()
        proto.writeFieldEnd()
        proto.writeFieldStop()
        proto.writeStructEnd()
        proto.writeFieldEnd()

    return write


def test_thrift_is_the_apache_library_not_the_idl_folder():
    assert thrift.__file__ is not None
    assert Path(thrift.__file__).resolve().parent != _REPO_ROOT / "thrift"


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_ping_and_panels(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)

    assert call(server, transport, protocol, "ping", no_args) == (TMessageType.REPLY, {0: "pong"})
    assert call(server, transport, protocol, "panels", no_args) == (
        TMessageType.REPLY,
        {0: ["alerts", "errors", "latency", "urls"]},
    )


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_get_app_stats(start_server, handler, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)

    message_type, result = call(server, transport, protocol, "get_app_stats", stats_request("shop"))

    assert message_type == TMessageType.REPLY
    response = result[0]
    assert response[1] == "shop"
    assert response[2]["errors"] == {1: {1: 3, 2: [{1: "KeyError: 'id'", 2: 3}]}}
    assert response[2]["latency"] == {3: {1: [{1: 1_000, 2: 12.5}, {1: 2_000, 2: 7.25}], 2: 1_000}}
    assert response[2]["alerts"][4][1][0][2] == "critical"
    timed_out = response[3][-1]
    assert (timed_out[1], timed_out[3], timed_out[7]) == ("volume", 2, True)
    assert response[5] == 4.5
    sent = handler.requests[-1]
    assert (sent.app, sent.start_ms, sent.end_ms, sent.panels) == (
        "shop",
        1_000,
        2_000,
        ["errors", "latency"],
    )


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_declared_and_internal_errors(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)

    assert call(server, transport, protocol, "get_app_stats", stats_request("")) == (
        TMessageType.REPLY,
        {1: {1: "app must not be empty", 2: "app"}},
    )
    message_type, error = call(
        server, transport, protocol, "get_app_stats", stats_request("internal")
    )
    assert message_type == TMessageType.EXCEPTION
    assert error.type == TApplicationException.INTERNAL_ERROR
    assert error.message.startswith("internal error (request id ")


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_old_style_binary_clients_are_served_by_default(start_server, handler, transport):
    server = start_server(transport=transport)
    assert call(server, transport, "binary", "ping", no_args, strict=False) == (
        TMessageType.REPLY,
        {0: "pong"},
    )
    message_type, result = call(
        server, transport, "binary", "get_app_stats", stats_request("shop"), strict=False
    )
    assert message_type == TMessageType.REPLY and result[0][1] == "shop"
    assert call(server, transport, "binary", "get_app_stats", stats_request(""), strict=False) == (
        TMessageType.REPLY,
        {1: {1: "app must not be empty", 2: "app"}},
    )


def test_old_style_binary_is_refused_with_strict_binary(start_server):
    server = start_server(transport="framed", strict_binary=True)
    with pytest.raises(TTransportException):
        call(server, "framed", "binary", "ping", no_args, strict=False)
    assert server.stats.malformed_messages == 1
    # Strict clients are unaffected.
    assert call(server, "framed", "binary", "ping", no_args) == (TMessageType.REPLY, {0: "pong"})
