"""Plain thriftpy2 clients and hand-encoded calls, so wire tests do not depend on our client."""

from __future__ import annotations

import struct
from typing import Any

from thriftpy2.protocol import TCompactProtocol, TCyBinaryProtocol
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.rpc import make_client
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TCyBufferedTransport, TCyFramedTransport
from thriftpy2.transport.memory import TMemoryBuffer

from service.idl import appstats

__all__ = ["thrift_client", "encode_call", "frame"]

_FACTORIES = {
    "framed": TCyFramedTransport,
    "buffered": TCyBufferedTransport,
    "binary": TCyBinaryProtocol,
    "compact": TCompactProtocol,
}


class _Factory:
    """What make_client wants for a transport or protocol: a class with one method."""

    def __init__(self, build: Any) -> None:
        self.get_transport = self.get_protocol = build


def thrift_client(server: Any, transport: str = "framed", protocol: str = "binary") -> Any:
    """A plain thriftpy2 client of ``server.address``, with a 5 s timeout."""
    return make_client(
        appstats.AppStats,
        *server.address,
        timeout=5000,
        proto_factory=_Factory(_FACTORIES[protocol]),
        trans_factory=_Factory(_FACTORIES[transport]),
    )


def encode_call(method: str, args: Any, protocol: str = "binary") -> bytes:
    """One CALL message (seqid 7), unframed, encoded by thriftpy2's pure-Python protocols."""
    buffer = TMemoryBuffer()
    proto = TBinaryProtocol(buffer) if protocol == "binary" else TCompactProtocol(buffer)
    proto.write_message_begin(method, TMessageType.CALL, 7)
    args.write(proto)
    proto.write_message_end()
    return buffer.getvalue()


def frame(payload: bytes) -> bytes:
    """``payload`` behind its four-byte length, as the framed transport sends it."""
    return struct.pack("!i", len(payload)) + payload


def apache_thrift_ping(socket: Any, seqid: int = 3) -> None:
    """Open ``socket`` (an Apache Thrift ``TSocket``/``TSSLSocket``) framed, and call ``ping``
    written by hand with Apache Thrift's own binary protocol; asserts the ``pong``."""
    from thrift.protocol.TBinaryProtocol import TBinaryProtocol as ApacheBinary
    from thrift.Thrift import TMessageType as ApacheMessageType
    from thrift.transport.TTransport import TFramedTransport

    socket.setTimeout(5000)
    transport = TFramedTransport(socket)
    proto = ApacheBinary(transport)
    transport.open()
    try:
        proto.writeMessageBegin("ping", ApacheMessageType.CALL, seqid)
        proto.writeStructBegin("ping_args")
        proto.writeFieldStop()
        proto.writeStructEnd()
        proto.writeMessageEnd()
        transport.flush()
        assert proto.readMessageBegin() == ("ping", ApacheMessageType.REPLY, seqid)
        proto.readStructBegin()
        _, _, field_id = proto.readFieldBegin()
        assert (field_id, proto.readString()) == (0, "pong")
    finally:
        transport.close()
