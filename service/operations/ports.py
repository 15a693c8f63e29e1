"""Listening sockets, and the error for a port that cannot be bound.

Every port Fanout listens on (the Thrift listener, the probes, the Prometheus
scrape) is bound at start-up; one that cannot be bound raises the OSError of
:func:`cannot_listen`, whose text names the address, and ``fanout serve`` exits
with it: never a restart loop.
"""

from __future__ import annotations

import socket

__all__ = ["LISTEN_BACKLOG", "bind_listener", "cannot_listen"]

LISTEN_BACKLOG = 4096


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening; raises OSError if it cannot be.

    ``host`` is used as given (an IPv6 literal if it contains ``:``), so no
    resolver thread starts in the master.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise cannot_listen(host, port, exc) from exc
    return sock


def cannot_listen(host: str, port: int, error: OSError) -> OSError:
    """The OSError to raise for a port that cannot be bound: its text names the address,
    ``cannot listen on HOST:PORT (reason)``, which ``fanout serve`` prints as it is."""
    return OSError(error.errno, f"cannot listen on {host}:{port} ({error.strerror or error})")
