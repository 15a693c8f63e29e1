"""The master's private line to each worker: messages, with a socket descriptor when one moves.

Each worker gets one end of a ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` as its only
inherited descriptor besides the standard streams. A packet keeps its bounds, so
one ``send`` is one message, and a descriptor sent with it (``SCM_RIGHTS``,
:func:`socket.send_fds`) arrives with that message and no other.

A message is a dict pickled with the highest protocol. Both ends are our own
processes on a socket pair nobody else holds, so nothing untrusted is unpickled.

What goes over it (``kind``):

=============  ==============  ====================================================
kind           direction       what
=============  ==============  ====================================================
``start``      master → worker the settings, the position, and the listener (an fd)
``state``      worker → master twice a second: connections, pools, circuits
``group``      master → worker every second: the backend checks, every worker's pools
``move``       master → worker hand over ``count`` idle connections (rebalance)
``retire``     master → worker hand over every connection, then drain and exit
``moved``      worker → master one connection (an fd) with the bytes read of it
``adopt``      master → worker serve this connection (an fd), those bytes first
``counts``     worker → master once drained: its last exposition (zlib), which outlives it
=============  ==============  ====================================================
"""

from __future__ import annotations

import copyreg
import os
import pickle
import socket
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

__all__ = ["ControlLine", "control_pair", "MAX_MESSAGE_BYTES"]


# Settings hold their tables read-only (MappingProxyType), which pickle cannot take as
# they are: a proxy travels as the dict it shows and is rebuilt read-only.
def _read_only(table: dict[str, Any]) -> MappingProxyType[str, Any]:
    return MappingProxyType(table)


copyreg.pickle(MappingProxyType, lambda proxy: (_read_only, (dict(proxy),)))

#: The largest message: a moved connection carries at most one read of unread bytes
#: (64 KiB, :mod:`service.wire.channel`); the start message, the settings.
MAX_MESSAGE_BYTES = 1024 * 1024


def control_pair() -> tuple[ControlLine, socket.socket]:
    """The master's end, and the worker's end as a plain socket to pass to the child."""
    master_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (master_end, worker_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE_BYTES)
    return ControlLine(master_end), worker_end


class ControlLine:
    """One end of the line: :meth:`send` and :meth:`receive` whole messages.

    Both block only the calling greenlet (the socket is gevent's where the process
    is patched). :meth:`receive` returns ``None`` once the other end has gone.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def from_fd(cls, fd: int) -> ControlLine:
        return cls(socket.socket(fileno=fd))

    def send(self, message: dict[str, Any], fd: int | None = None) -> None:
        """Send ``message``, and a duplicate of descriptor ``fd`` with it.

        Raises OSError when the other end has gone (``BrokenPipeError``).
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {len(data)} bytes over {MAX_MESSAGE_BYTES}")
        socket.send_fds(self.sock, [data], [fd] if fd is not None else [])

    def offer(self, message: dict[str, Any], fd: int | None = None) -> bool:
        """:meth:`send`, but False instead of an OSError when the other end has gone."""
        try:
            self.send(message, fd)
        except OSError:
            return False
        return True

    def receive(self) -> tuple[dict[str, Any], int | None] | None:
        """The next message and the descriptor that came with it, or None at the end."""
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
        if not data:
            for fd in fds:
                _close_fd(fd)
            return None
        return pickle.loads(data), (fds[0] if fds else None)

    def messages(self) -> Iterator[tuple[dict[str, Any], int | None]]:
        """Each message as it comes, until the other end has gone (or this end is closed)."""
        while True:
            try:
                received = self.receive()
            except OSError:
                return
            if received is None:
                return
            yield received

    def close(self) -> None:
        self.sock.close()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
