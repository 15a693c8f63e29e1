"""Refusing baseline: the floor of what refusing a caller who ignores ``retry_after_ms`` costs.

A gevent ``StreamServer`` that answers every framed, binary call but ``ping``
``Overloaded`` (as ``get_app_stats`` would be), from its header alone, after the hold
that pacing gives such a caller (:mod:`service.engine.pacing`, with the deadline the
call's ``meta`` would carry: ``fanout.request_deadline_ms``). The reply is encoded once;
only its seqid changes. No admission, no wire scan (a frame is only bounded by
``server.max_frame_bytes``), no metrics, no logging: a read, a timer and a write per
refusal, which is what any gevent server must spend to answer each such caller within
its deadline. The overload scenario sets its CPU per refusal beside Fanout's.

    python -m bench.baselines.refusing --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

from gevent import monkey

monkey.patch_all()

import socket  # noqa: E402
import struct  # noqa: E402
from typing import Any, Optional, Sequence  # noqa: E402

import gevent  # noqa: E402
from gevent.pool import Pool  # noqa: E402
from gevent.server import StreamServer  # noqa: E402
from thriftpy2.protocol import TCyBinaryProtocol  # noqa: E402
from thriftpy2.thrift import TMessageType  # noqa: E402
from thriftpy2.transport import TCyMemoryBuffer  # noqa: E402

from bench.baselines.common import settings_from_argv  # noqa: E402
from bench.harness.ready import announce_ready, wait_for_stop_signal  # noqa: E402
from service.engine.deadline import Deadline  # noqa: E402
from service.engine.pacing import CallerPacing  # noqa: E402
from service.idl import appstats  # noqa: E402
from service.wire.header import call_header  # noqa: E402

__all__ = ["encoded_replies", "serve_refusing", "main"]

_FRAME = struct.Struct("!i")
_READ_BYTES = 65536
#: retry_after_ms in the reply: as long as admission's longest, so the hold is the deadline's.
_RETRY_AFTER_MS = 10_000


def encoded_replies() -> dict[str, tuple[bytes, int]]:
    """Framed replies with seqid 0, and where their seqid is: ``get_app_stats`` answered
    ``Overloaded``, and ``ping`` (the harness pings a server before it loads it)."""
    ping = appstats.AppStats.ping_result(success="pong")
    refusal = appstats.AppStats.get_app_stats_result(
        overloaded=appstats.Overloaded(message="overloaded", retry_after_ms=_RETRY_AFTER_MS))
    return {name: _encoded(name, result) for name, result in
            (("ping", ping), ("get_app_stats", refusal))}


def _encoded(method: str, result: Any) -> tuple[bytes, int]:
    buffer = TCyMemoryBuffer()
    protocol = TCyBinaryProtocol(buffer)
    protocol.write_message_begin(method, TMessageType.REPLY, 0)
    result.write(protocol)
    protocol.write_message_end()
    body = buffer.getvalue()
    # Strict binary header: version and type (4 bytes), the name (4 + its length), the seqid.
    return _FRAME.pack(len(body)) + body, _FRAME.size + 8 + len(method)


def _read_frame(sock: socket.socket, max_frame_bytes: int) -> Optional[bytes]:
    """One whole frame's body, or None at the end of the stream or for a frame longer
    than ``max_frame_bytes`` (the connection is then closed)."""
    data = b""
    while len(data) < _FRAME.size or len(data) < _FRAME.size + _FRAME.unpack_from(data)[0]:
        if len(data) >= _FRAME.size and not 0 <= _FRAME.unpack_from(data)[0] <= max_frame_bytes:
            return None
        more = sock.recv(_READ_BYTES)
        if not more:
            return None
        data += more
    return data[_FRAME.size:]


def serve_refusing(deadline_ms: int, max_frame_bytes: int = 1024 * 1024) -> Any:
    """A ``StreamServer`` handler answering ``ping``, and refusing every other call, paced."""
    replies = encoded_replies()

    def serve(sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pacing = CallerPacing()
        try:
            while (body := _read_frame(sock, max_frame_bytes)) is not None:
                header = call_header(body, "binary")
                if header is None:
                    return
                method, seqid = header
                if method != "ping":
                    method = "get_app_stats"
                    deadline = Deadline.after_ms(deadline_ms)
                    pacing.arrived(deadline)
                    gevent.sleep(pacing.refused(_RETRY_AFTER_MS, deadline))
                reply, seqid_at = replies[method]
                sock.sendall(reply[:seqid_at] + _FRAME.pack(seqid) + reply[seqid_at + 4:])
        except OSError:
            pass
        finally:
            sock.close()
    return serve


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.refusing", argv)
    server = StreamServer((settings.server.host, settings.server.port),
                          serve_refusing(settings.fanout.request_deadline_ms,
                                         settings.server.max_frame_bytes),
                          spawn=Pool(settings.server.max_connections))
    server.start()
    host, port = server.address[:2]
    announce_ready(host=host, port=port, server="refusing")
    wait_for_stop_signal()
    server.stop(timeout=1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
