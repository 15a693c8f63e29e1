"""What the master and its workers need of the operating system: the shared listener,
dying with the master, and signal names for the log."""

from __future__ import annotations

import os
import signal
import socket

__all__ = ["LISTEN_BACKLOG", "bind_listener", "end_with_master", "signal_name"]

LISTEN_BACKLOG = 4096
_PR_SET_PDEATHSIG = 1


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
    except OSError:
        sock.close()
        raise
    return sock


def end_with_master(master_pid: int) -> None:
    """Have the kernel send this worker SIGTERM if the master dies (Linux), so none is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: a killed master leaves its workers to be stopped by hand
    if os.getppid() != master_pid:  # the master died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
