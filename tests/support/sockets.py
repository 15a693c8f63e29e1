"""Small helpers the tests share: polling for a condition, ports, raw connections, listeners."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import gevent
import psutil

__all__ = ["wait_for", "dead_port", "raw_connection", "listening_addresses"]

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T],
    timeout_s: float = 5.0,
    what: str = "condition",
    poll_s: float = 0.01,
) -> Any:
    """Poll ``condition`` until it returns something truthy, and return that (typed Any: a
    condition such as ``(w := workers()) and len(w) == 2 and w`` is typed with its falsy
    answers, which this never returns).

    The first polls are ``poll_s`` apart, and each wait half again as long as the last, up
    to :data:`LONGEST_POLL_S`: what is true at once is seen at once, and a condition that
    scrapes or calls a server is not asked a hundred times a second while a worker starts
    (on a busy 2-core machine that polling was CPU the servers under test needed).

    Raises AssertionError naming ``what`` if it is still falsy after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pause = poll_s
    while not (result := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        gevent.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = max(pause, min(pause * 1.5, LONGEST_POLL_S))
    return result


#: The longest pause between two polls of :func:`wait_for`.
LONGEST_POLL_S = 0.05


def dead_port() -> int:
    """A port of 127.0.0.1 with nothing listening on it (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def raw_connection(server: Any) -> socket.socket:
    """A plain TCP connection to ``server.address``, with a 5 s timeout on each operation."""
    return socket.create_connection(server.address, timeout=5)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """The (host, port) every TCP socket of ``pid`` and its descendants listens on.

    Asked of the processes themselves (psutil, as ``workers.py`` counts a worker's
    connections): connecting to a host and port to see that nothing answers can reach
    another process that happens to listen there.
    """
    root = psutil.Process(pid)
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            found |= {
                (c.laddr.ip, c.laddr.port)
                for c in process.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.NoSuchProcess:
            continue  # gone meanwhile
    return found
