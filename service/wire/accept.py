"""An accept loop that survives running out of file descriptors.

gevent's ``StreamServer`` already survives a failing ``accept()``: it reports
the error through the hub (a full traceback on stderr, every attempt) and
retries after a short, doubling delay. When the process runs out of file
descriptors or kernel memory (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``)
that becomes a stream of tracebacks while nothing is wrong with the code.

:class:`ResilientStreamServer` handles those four errors deliberately:

* it pauses accepting, for ``pause_min_s`` at first, doubling up to
  ``pause_max_s`` while the errors continue, and resumes by itself; pending
  connections wait in the kernel's listen backlog meanwhile (the same place
  they wait while the connection pool is full);
* it logs one WARNING per ``warn_interval_s`` (how many failures since the last
  one, and what to do about it), never a traceback, and an INFO line once an
  accept succeeds again;
* it counts the failures (:attr:`ResilientStreamServer.accept_resource_errors`).

Every other accept error goes through gevent's handling unchanged.

Why our own rather than gevent's back-off alone: ``BaseServer._do_read`` already
pauses and doubles its delay after a failed accept, but reports each failure
through ``hub.handle_error`` (a traceback on stderr per attempt), and a hub's error
handling cannot be changed for one server. The pause here reuses gevent's
mechanism (``stop_accepting`` and a timer); only the reporting and counting differ.
"""

from __future__ import annotations

import errno
import logging
import resource
from typing import Any

from gevent.server import StreamServer

from lookups.clock import loop_time

__all__ = ["ResilientStreamServer", "RESOURCE_ERRNOS", "fd_headroom_warning"]

log = logging.getLogger(__name__)

#: ``accept()`` errors that mean "no resources right now", not "this socket is broken".
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# File descriptors a server needs besides its connections: listener, event loop,
# log files, MongoDB and HTTP pools. A rough floor, only used for the start-up warning.
_FDS_BESIDES_CONNECTIONS = 64


class ResilientStreamServer(StreamServer):
    """A ``StreamServer`` that pauses, instead of failing, while accept() lacks resources.

    Construction and use are those of ``gevent.server.StreamServer``.
    """

    pause_min_s = 0.05  # first pause after a resource error
    pause_max_s = 1.0  # the pause doubles up to this while errors continue
    warn_interval_s = 10.0  # at most one warning per interval

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pause_s = self.pause_min_s
        self._resource_errors = 0
        self._unreported = 0  # failures since the last warning
        self._warned_at = -float("inf")
        self._exhausted = False  # between a failure and the next successful accept

    @property
    def accept_resource_errors(self) -> int:
        """accept() calls that failed with one of :data:`RESOURCE_ERRNOS` since construction."""
        return self._resource_errors

    def start(self) -> None:
        """Start accepting; logs a warning if the pool could outgrow the open-files limit."""
        super().start()
        warning = fd_headroom_warning(self.pool.size if self.pool is not None else None)
        if warning:
            log.warning("%s", warning)

    def do_read(self) -> tuple[Any, Any] | None:
        # Called by gevent's accept loop (BaseServer._do_read) for every accept.
        try:
            accepted = super().do_read()
        except OSError as exc:
            if exc.errno not in RESOURCE_ERRNOS:
                raise
            self._pause_after(exc)
            return None  # gevent's loop then returns and waits for our timer
        if accepted is not None and self._exhausted:
            self._exhausted = False
            self._pause_s = self.pause_min_s
            log.info(
                "accepting connections again after %d failed accept(s) for lack of resources",
                self._resource_errors,
            )
        result: tuple[Any, Any] | None = accepted
        return result

    def _pause_after(self, exc: OSError) -> None:
        self._resource_errors += 1
        self._unreported += 1
        self._exhausted = True
        pause_s = self._pause_s
        self._pause_s = min(self.pause_max_s, pause_s * 2)
        now = loop_time(self.loop)  # the time its pause timers count in
        if now - self._warned_at >= self.warn_interval_s:
            self._warned_at = now
            log.warning(
                "accept() failed: %s (%d time(s) since the last warning); pausing accepts for "
                "%.0f ms, new connections wait in the listen backlog. Raise the open-files limit "
                "(ulimit -n) or lower server.max_connections",
                exc.strerror or exc,
                self._unreported,
                pause_s * 1000.0,
            )
            self._unreported = 0
        # The same mechanism gevent uses after an accept error: drop the watcher, re-arm
        # it from a timer. A full connection pool still takes precedence when it fires.
        self.stop_accepting()
        self._timer = self.loop.timer(pause_s)
        self._timer.start(self._start_accepting_if_started)


def fd_headroom_warning(max_connections: int | None) -> str:
    """A warning if ``max_connections`` plus a margin exceeds the soft open-files limit, else
    ``""``."""
    if not max_connections:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or max_connections + _FDS_BESIDES_CONNECTIONS <= soft:
        return ""
    return (
        f"server.max_connections is {max_connections} but the open-files limit is {soft}: "
        f"past about {max(soft - _FDS_BESIDES_CONNECTIONS, 0)} connections accept() will fail "
        f"(EMFILE) and the server will pause accepting; raise the limit (ulimit -n)"
    )
