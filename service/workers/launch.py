"""Starting one worker process, and the master's handle on it.

A worker is started as a program of its own (``python -P -m
service.workers.worker``), not forked from the master, so that it inherits no
descriptor but its control line (:mod:`service.workers.worker` says why). Its
exit and everything it says on the line become events on the master's queue:
``("exit", pid, exit code)`` and ``("control", pid, message, fd)``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.subprocess
from gevent.queue import Queue

from service.settings.config import Settings
from service.workers.control import ControlLine, control_pair
from tracing.context import spawn_in_context

__all__ = ["WorkerLink", "launch_worker"]

log = logging.getLogger(__name__)

_LAST_WORDS_S = 1.0  # the longest an exit waits for the worker's last messages to be read


@dataclass
class WorkerLink:
    """The master's handle on one running worker."""

    pid: int
    position: int
    serial: int
    line: ControlLine
    process: Any
    #: Connections it serves and keeps (not moving): as it last reported, plus those given since.
    connections: int = 0
    pools: dict[str, Any] | None = None
    circuits: dict[str, str] = field(default_factory=dict)
    stores: tuple[Any, ...] = ()  # the results cache's shared store as it last reported
    retiring: bool = False

    def tell(self, message: dict[str, Any], fd: int | None = None) -> bool:
        """Send ``message`` (and a copy of ``fd``); False if the worker has gone."""
        return self.line.offer(message, fd)


def launch_worker(
    settings: Settings,
    position: int,
    serial: int,
    workers: int,
    *,
    listener: socket.socket,
    heartbeats: str,
    events: Queue,
) -> WorkerLink:
    """Start the worker for ``position`` and send it its start; raises OSError if it cannot
    start."""
    line, worker_end = control_pair()
    try:
        process = gevent.subprocess.Popen(
            [sys.executable, "-P", "-m", "service.workers.worker", str(worker_end.fileno())],
            pass_fds=[worker_end.fileno()],
        )
    except OSError:
        line.close()
        raise
    finally:
        worker_end.close()
    link = WorkerLink(process.pid, position, serial, line, process)
    link.tell(
        {
            "kind": "start",
            "settings": settings,
            "position": position,
            "serial": serial,
            "workers": workers,
            "master_pid": os.getpid(),
            "heartbeats": heartbeats,
            "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        },
        listener.fileno(),
    )
    reader = spawn_in_context(_read, link, events)
    spawn_in_context(_wait, link, events, reader)
    return link


def _read(link: WorkerLink, events: Queue) -> None:
    for message, fd in link.line.messages():
        events.put(("control", link.pid, message, fd))


def _wait(link: WorkerLink, events: Queue, reader: gevent.Greenlet) -> None:
    code = link.process.wait()
    # What the worker said before it went (its last counts) comes before its exit; the
    # line ends when the worker's end closes, which its exit does.
    reader.join(timeout=_LAST_WORDS_S)
    link.line.close()
    events.put(("exit", link.pid, code))
