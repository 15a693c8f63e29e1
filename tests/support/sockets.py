"""Small helpers the tests share: polling for a condition, ports, raw connections, listeners."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import gevent

__all__ = ["wait_for", "dead_port", "raw_connection", "listening_addresses"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float = 5.0, what: str = "condition",
             poll_s: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

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

    Read from ``/proc``, so a test asks the process itself: connecting to a host and port to
    see that nothing answers can reach another process that happens to listen there.
    """
    inodes = {link[len("socket:["):-1] for tree_pid in _process_tree(pid)
              for link in _fd_links(tree_pid) if link.startswith("socket:[")}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                found.add((_proc_net_host(host), int(port, 16)))
    return found


def _process_tree(pid: int) -> list[int]:
    tree, parents = [pid], {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command (field 2) may hold spaces: the parent is the 2nd field after it.
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    for candidate in tree:
        tree += [child for child, parent in parents.items() if parent == candidate]
    return tree


def _fd_links(pid: int) -> list[str]:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []  # gone meanwhile
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor is one)
    return links


def _proc_net_host(hex_host: str) -> str:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host byte order."""
    words = bytes.fromhex(hex_host)
    packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    return str(ipaddress.ip_address(packed))
