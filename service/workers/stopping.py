"""Stopping every worker: SIGTERM, a wait as long as their drain may take, then SIGKILL.

Each worker drains on SIGTERM (lame duck, drain, abandoned tasks' grace, span flush);
those still running after :func:`drain_time_s` are killed, and the master waits a
little more for their exits. A connection a worker hands over meanwhile is closed.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from gevent.queue import Empty, Queue

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.settings.config import Settings

__all__ = ["stop_workers", "drain_time_s", "send_signal"]

log = logging.getLogger("service.workers.master")

_STOP_MARGIN_S = 3.0  # beyond the drain, grace and flush budgets, before SIGKILL
_KILL_WAIT_S = 5.0


def drain_time_s(settings: Settings) -> float:
    """How long a worker may take to drain after SIGTERM, with a margin."""
    server = settings.server
    return (
        server.lame_duck_ms
        + server.drain_timeout_ms
        + settings.fanout.abandon_grace_ms
        + settings.tracing.flush_timeout_ms
    ) / 1000.0 + _STOP_MARGIN_S


def stop_workers(
    links: dict[int, Any], events: Queue, timeout_s: float, clock: Clock = SYSTEM_CLOCK
) -> None:
    """SIGTERM every worker in ``links`` (by pid), book their exits from ``events``, and
    SIGKILL those still running after ``timeout_s`` of ``clock``."""
    for pid in list(links):
        send_signal(pid, signal.SIGTERM)
    if not _wait_for_exits(links, events, Deadline.after_s(timeout_s, clock)):
        live = sorted(links)
        log.warning(
            "master: %d worker(s) still running after %.1f s; killing %s",
            len(live),
            timeout_s,
            live,
        )
        for pid in live:
            send_signal(pid, signal.SIGKILL)
        _wait_for_exits(links, events, Deadline.after_s(_KILL_WAIT_S, clock))


def send_signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # already gone; its exit event is on the way


def _wait_for_exits(links: dict[int, Any], events: Queue, deadline: Deadline) -> bool:
    """Book exits until no worker is left or ``deadline`` passes; True if none is left."""
    while links:
        remaining = deadline.remaining_s()
        if remaining <= 0:
            return False
        try:
            event = events.get(timeout=remaining)
        except Empty:
            return False
        if event[0] == "exit":
            links.pop(event[1], None)
            log.info("master: worker %d stopped (exit code %d)", event[1], event[2])
        elif event[0] == "control" and event[3] is not None:
            os.close(event[3])  # a connection handed over while stopping: it closes
        elif event[0] == "signal":
            log.info(
                "master: %s received while stopping; still waiting for the workers",
                signal.Signals(event[1]).name,
            )
    return True
