"""Reused greenlets for the engine's short tasks, each job in a copy of its starter's context."""

from __future__ import annotations

import contextvars
import logging
import sys
from typing import Any, Callable, Optional

from gevent.hub import get_hub
from greenlet import getcurrent
from greenlet import greenlet as RawGreenlet

__all__ = ["TaskRunners"]

log = logging.getLogger(__name__)

_Job = tuple  # (contextvars.Context, function, args)


class TaskRunners:
    """Reused greenlets, each running one function at a time in a copy of its starter's context.

    Why: starting a greenlet costs more than the rest of a short task (CPython 3.11+
    maps, then unmaps, a fresh frame stack for every new greenlet). A runner parks
    in the hub after each job and takes the next one, so a busy process creates
    greenlets only to grow. At most ``max_idle`` parked runners are kept.

    A job runs in the context copied by :meth:`start`, as with
    :func:`tracing.greenlets.spawn_in_context`, so context variables never carry over from one job
    to the next. Greenlet-local state (``gevent.local``, a patched
    ``threading.local``) does: keep per-task state in context variables. A job
    that lets ``GreenletExit`` (or another ``BaseException``) escape ends its
    runner; the hub reports anything but ``GreenletExit``, as for any greenlet.
    """

    def __init__(self, max_idle: int = 256) -> None:
        self._max_idle = max_idle
        self._idle: list[RawGreenlet] = []

    @property
    def idle(self) -> int:
        """Runners parked and ready for a job."""
        return len(self._idle)

    def start(self, function: Callable[..., Any], *args: Any) -> None:
        """Run ``function(*args)`` soon, in a runner, in a copy of the caller's context.

        Like ``gevent.spawn``, the job starts once the caller yields to the hub.
        Exceptions the job raises are reported to the hub (logged), never to the caller.
        """
        job = (contextvars.copy_context(), function, args)
        hub = get_hub()
        runner = self._idle.pop() if self._idle else RawGreenlet(self._serve, hub)
        hub.loop.run_callback(self._resume, runner, job)

    def _resume(self, runner: RawGreenlet, job: _Job) -> None:
        # Runs in the hub. A runner killed while parked cannot take the job; a new one does.
        if runner.dead:
            runner = RawGreenlet(self._serve, get_hub())
        runner.switch(job)

    def _serve(self, job: _Job) -> None:
        me, hub = getcurrent(), get_hub()
        while True:
            context, function, args = job
            try:
                context.run(function, *args)
            except Exception:
                hub.handle_error(me, *sys.exc_info())
            job = context = function = args = None  # a parked runner holds nothing of its job
            if len(self._idle) >= self._max_idle:
                return
            self._idle.append(me)
            job = self._park(me, hub)
            if job is None:
                return

    def _park(self, me: RawGreenlet, hub: Any) -> Optional[_Job]:
        """Wait in the hub for the next job; ``None`` if woken by anything but :meth:`_resume`."""
        woken_by_start = False
        try:
            job = hub.switch()
            woken_by_start = type(job) is tuple and len(job) == 3
        finally:
            if not woken_by_start and me in self._idle:
                self._idle.remove(me)
        if not woken_by_start:
            log.warning("a parked task runner was woken by %r; ending it", job)
            return None
        return job


