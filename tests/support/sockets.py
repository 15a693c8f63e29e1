"""Small helpers the tests share: polling for a condition, ports, raw connections."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable, TypeVar

import gevent

__all__ = ["wait_for", "dead_port", "raw_connection"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float = 5.0, what: str = "condition",
             poll_s: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Raises AssertionError naming ``what`` if it is still falsy after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        gevent.sleep(poll_s)
    return result


def dead_port() -> int:
    """A port of 127.0.0.1 with nothing listening on it (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def raw_connection(server: Any) -> socket.socket:
    """A plain TCP connection to ``server.address``, with a 5 s timeout on each operation."""
    return socket.create_connection(server.address, timeout=5)
