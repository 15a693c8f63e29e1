"""Moving a live connection to another process, between two calls, with nothing lost.

A connection moves when the pre-forked group retires a worker (a reload, one
worker fewer) or spreads connections again after a worker was replaced
(:mod:`service.workers.balance`). It moves only at a point where no call of it is
in this process: between a reply and the next call. What moves is the socket
itself (its descriptor, over the worker's control line, :mod:`service.workers.control`)
and the bytes already read of the next call, so the peer, whatever its Thrift
client, sees one connection that goes on answering.

* A connection waiting for its next call, nothing of it read, is interrupted
  there (:class:`MoveNow`, thrown from a callback of the hub only while its
  greenlet is still blocked in that read), and moves at once.
* A connection serving a call moves after its reply is written.
* A held connection (:mod:`service.overload.held_connections`) moves once released.
* A TLS connection never moves: its session keys live in this process's
  OpenSSL state. It drains as before (closed between calls; the peer reconnects).

Why hand over descriptors rather than apply a new configuration inside the
running workers: a reload may change anything (backends, pools, TLS files,
lookups), and rebuilding those under live calls would need every part to swap
its state safely; a new process is the one way every setting takes effect the
same. Why descriptors rather than a proxy in the master: a proxy would carry
every byte of every call through one more process and one more core. What a move
costs a caller (one more hop through the master for the next call, beside a new
generation starting) is measured by ``make bench-group`` (the manual's Performance page).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Protocol

import gevent

__all__ = ["MoveNow", "MoveSink", "Movable", "request_move"]

#: Takes the socket and the bytes read of it not yet served; returns True once the
#: connection is in another process's hands (then this process only closes its copy).
MoveSink = Callable[[socket.socket, bytes], bool]


class MoveNow(Exception):
    """Thrown into a connection's greenlet blocked waiting for a new call: move now."""


class Movable(Protocol):
    """What a connection offers to be moved (:class:`service.listener.served.ServedConnection`)."""

    moving: MoveSink | None
    greenlet: gevent.Greenlet | None
    channel: Any  # its waiting_idle says whether it is blocked waiting for a call


def request_move(connection: Movable, sink: MoveSink) -> None:
    """Have ``connection`` move to ``sink`` at its next point between calls.

    If it is waiting for a call now, it is interrupted from the hub, and only if it
    is still waiting when the hub gets to it.
    """
    connection.moving = sink
    if connection.channel.waiting_idle and connection.greenlet is not None:
        gevent.get_hub().loop.run_callback(_interrupt_if_waiting, connection)


def _interrupt_if_waiting(connection: Movable) -> None:
    # Runs in the hub. The flag is cleared in the greenlet as soon as its read returns,
    # before it can switch again: still set, nothing of the next call has been read.
    greenlet = connection.greenlet
    if connection.channel.waiting_idle and greenlet is not None and not greenlet.dead:
        greenlet.throw(MoveNow())
