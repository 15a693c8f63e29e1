"""The project files one warm ``get_app_stats`` runs on the server, traced, for the path
that ``docs/architecture.md`` writes down (``tests/test_call_path.py``).

The call goes over a connection that has already served two, so accepting it is not
on the path. What runs in greenlets counts (the connection's, and the task runners');
not the hub's own callbacks, not the backend checks that run on a schedule
(``HealthChecker``), not the sample backends (``service/samples/``), not the test.
"""

from __future__ import annotations

import socket
import struct
import sys
from pathlib import Path
from typing import Any

import gevent

__all__ = ["PROJECT_PACKAGES", "files_of_one_warm_call"]

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("service", "lookups", "tracing")


def _project_file(filename: str) -> str:
    """``filename`` relative to the checkout if it is one of the server's own, else ''."""
    try:
        relative = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return ""
    parts = relative.parts
    if parts[0] not in PROJECT_PACKAGES or parts[:2] == ("service", "samples"):
        return ""
    return str(relative)


def _exchange(sock: socket.socket, call: bytes) -> bytes:
    sock.sendall(call)
    header = sock.recv(4, socket.MSG_WAITALL)
    size = struct.unpack("!i", header)[0]
    reply = b""
    while len(reply) < size:
        reply += sock.recv(size - len(reply))
    return reply


def files_of_one_warm_call(address: tuple[str, int], call: bytes) -> set[str]:
    """The server's own files that one call (``call``: a framed message) runs, once the
    same connection has served it twice."""
    with socket.create_connection(address, timeout=10) as sock:
        _exchange(sock, call)
        _exchange(sock, call)
        hub = gevent.get_hub()
        ran: set[str] = set()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                current = gevent.getcurrent()
                if current is not hub and not _scheduled(current):
                    name = _project_file(frame.f_code.co_filename)
                    if name:
                        ran.add(name)

        sys.setprofile(profile)
        try:
            _exchange(sock, call)
        finally:
            sys.setprofile(None)
    return ran


def _scheduled(greenlet: Any) -> bool:
    """A greenlet of the backend checks, which run every few seconds whatever the calls."""
    return any(getattr(arg, "__qualname__", "").startswith("HealthChecker.")
               for arg in getattr(greenlet, "args", ()))
