"""Refusing baseline: the floor of what refusing a caller who ignores ``retry_after_ms`` costs.

A gevent ``StreamServer`` that answers every framed, binary call but ``ping``
``Overloaded`` (as ``get_app_stats`` would be), from its header alone, after the hold
that pacing gives such a caller (:mod:`service.overload.gate`, with the deadline the
call's ``meta`` would carry: ``fanout.request_deadline_ms``). The reply is encoded once;
only its seqid changes. No admission, no wire scan (a frame is only bounded by
``server.max_frame_bytes``), no metrics, no logging: a read, a timer and a write per
refusal, each from a callback of the hub's loop with no greenlet woken, the holds
ending on the ticks Fanout's end on (``HOLD_TICK_S``), which is what a gevent server
must spend to answer each such caller within its deadline. The overload scenario sets
its CPU per refusal beside Fanout's.

    python -m bench.baselines.refusing --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

from gevent import monkey

monkey.patch_all()

import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

from gevent.event import Event
from gevent.hub import get_hub
from gevent.pool import Pool
from gevent.server import StreamServer
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TCyMemoryBuffer

from bench.baselines.common import settings_from_argv
from bench.servers.ready import announce_ready, wait_for_stop_signal
from lookups.deadline import Deadline
from service.idl import appstats
from service.overload.held_connections import on_the_tick
from service.overload.pacing import ConnectionPacing
from service.wire.header import call_header

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
        overloaded=appstats.Overloaded(message="overloaded", retry_after_ms=_RETRY_AFTER_MS)
    )
    return {
        name: _encoded(name, result)
        for name, result in (("ping", ping), ("get_app_stats", refusal))
    }


def _encoded(method: str, result: Any) -> tuple[bytes, int]:
    buffer = TCyMemoryBuffer()
    protocol = TCyBinaryProtocol(buffer)
    protocol.write_message_begin(method, TMessageType.REPLY, 0)
    result.write(protocol)
    protocol.write_message_end()
    body = buffer.getvalue()
    # Strict binary header: version and type (4 bytes), the name (4 + its length), the seqid.
    return _FRAME.pack(len(body)) + body, _FRAME.size + 8 + len(method)


class _RefusingConnection:
    """One connection, served from callbacks of the hub's loop: a read when the caller
    sends, a timer for the hold, a write when it ends (as service.overload.held_connections does)."""

    def __init__(
        self,
        sock: socket.socket,
        replies: dict[str, tuple[bytes, int]],
        deadline_ms: int,
        max_frame_bytes: int,
    ) -> None:
        self._fd = sock.fileno()
        self._replies = replies
        self._deadline_ms = deadline_ms
        self._max_frame_bytes = max_frame_bytes
        self._pacing = ConnectionPacing()
        self._buffer = b""
        self._seqid = 0
        self._loop = get_hub().loop
        self._io = self._loop.io(self._fd, 1)
        self._timer: Any = None
        self.done = Event()
        self._io.start(self._readable)

    def close(self) -> None:
        self._io.close()
        if self._timer is not None:
            self._timer.close()

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.done.set()
            return
        self._buffer += data
        self._next_call()

    def _next_call(self) -> None:
        if len(self._buffer) < _FRAME.size:
            return
        (length,) = _FRAME.unpack_from(self._buffer)
        if not 0 <= length <= self._max_frame_bytes:
            self.done.set()
            return
        if len(self._buffer) < _FRAME.size + length:
            return
        end = _FRAME.size + length
        body, self._buffer = self._buffer[_FRAME.size : end], self._buffer[end:]
        header = call_header(body, "binary")
        if header is None:
            self.done.set()
            return
        method, self._seqid = header
        if method == "ping":
            self._write("ping")
            self._next_call()
            return
        deadline = Deadline.after_ms(self._deadline_ms)
        self._pacing.arrived(deadline)
        self._io.stop()
        self._timer = self._loop.timer(
            on_the_tick(self._loop, self._pacing.refused(_RETRY_AFTER_MS, deadline))
        )
        self._timer.start(self._due)

    def _due(self) -> None:
        self._write("get_app_stats")
        self._io.start(self._readable)
        self._next_call()

    def _write(self, method: str) -> None:
        reply, seqid_at = self._replies[method]
        payload = reply[:seqid_at] + _FRAME.pack(self._seqid) + reply[seqid_at + 4 :]
        try:
            sent = os.write(self._fd, payload)
        except OSError:
            sent = 0
        if sent < len(payload):  # a peer not reading its replies: not this floor's business
            self.done.set()


def serve_refusing(deadline_ms: int, max_frame_bytes: int = 1024 * 1024) -> Any:
    """A ``StreamServer`` handler answering ``ping``, and refusing every other call, paced."""
    replies = encoded_replies()

    def serve(sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _RefusingConnection(sock, replies, deadline_ms, max_frame_bytes)
        try:
            connection.done.wait()
        finally:
            connection.close()
            sock.close()

    return serve


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.refusing", argv)
    server = StreamServer(
        (settings.server.host, settings.server.port),
        serve_refusing(settings.fanout.request_deadline_ms, settings.server.max_frame_bytes),
        spawn=Pool(settings.server.max_connections),
    )
    server.start()
    host, port = server.address[:2]
    announce_ready(host=host, port=port, server="refusing")
    wait_for_stop_signal()
    server.stop(timeout=1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
