"""A MongoDB-wire proxy that answers pymongo's monitor late: every ``hello`` a connection
sends after its first message (the monitor's checks; a connection's first message is its
handshake) is held back ``check_delay_ms`` before it reaches the server, as an engine busy
with other commands, or a stalled event loop, would answer it late. Other commands are held
back the proxy's own delay (:meth:`TcpFaultProxy.set_delay_ms`), so that a few callers keep
operations in flight without making the engine work flat out.
"""

from __future__ import annotations

import socket
import struct
import time

from service.samples.fault_proxy import TcpFaultProxy

__all__ = ["LateMonitorProxy", "command_name"]

_CHUNK_BYTES = 64 * 1024
_OP_QUERY, _OP_MSG = 2004, 2013
_HELLO = frozenset({"hello", "isMaster", "ismaster"})


def command_name(message: bytes) -> str:
    """The command a MongoDB wire message starts with ('' when it cannot be told)."""
    if len(message) < 21:
        return ""
    (opcode,) = struct.unpack_from("<i", message, 12)
    if opcode == _OP_MSG and message[20] == 0:  # section kind 0: the command document
        start = 21
    elif opcode == _OP_QUERY:
        start = message.find(b"\0", 20) + 1 + 8  # after the collection name, skip, return
    else:
        return ""
    key = start + 4 + 1  # the document's length, then its first element's type
    end = message.find(b"\0", key)
    return message[key:end].decode("latin-1") if end > key else ""


class LateMonitorProxy(TcpFaultProxy):
    """A :class:`TcpFaultProxy` to ``target`` holding back each monitor check
    ``check_delay_ms``; ``held`` counts the checks it held, ``abandoned`` those whose client
    gave up waiting (closed the connection: pymongo timed the check out)."""

    def __init__(self, target: tuple[str, int], check_delay_ms: int) -> None:
        super().__init__(target)
        self.check_delay_ms = check_delay_ms
        self.held = 0
        self.abandoned = 0

    def _pump(self, source: socket.socket, sink: socket.socket, towards_server: bool) -> bool:
        if not towards_server:
            return super()._pump(source, sink, towards_server)
        first = True
        try:
            while True:
                data = source.recv(_CHUNK_BYTES)
                if not data:
                    return False
                check = not first and command_name(data) in _HELLO
                delay_ms = self.check_delay_ms if check else 0 if first else self._delay_ms
                self.held += check
                if not self._hold(source, time.monotonic() + delay_ms / 1000.0):
                    self.abandoned += check
                    return False
                first = False
                sink.sendall(data)
        except OSError:
            return True
