"""The request context, and starting greenlets that keep it.

A new greenlet starts with an *empty* contextvars context, so a plain
``gevent.spawn`` would lose both the :class:`RequestContext` and the
OpenTelemetry current span. :func:`spawn_in_context` runs the child in a copy
of its parent's context instead; every child in this service is started that way.
:class:`TaskRunners` does the same for the engine's short tasks, on reused greenlets.

Lookups read the request through one accessor, :func:`current_request`.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

import gevent
from gevent import Greenlet
from gevent.hub import get_hub
from greenlet import getcurrent
from greenlet import greenlet as RawGreenlet

from service.deadline import Deadline

__all__ = ["RequestContext", "current_request", "use_request", "spawn_in_context", "TaskRunners",
           "new_request_id"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestContext:
    """What every part of one RPC may need to know about it.

    ``headers`` are the caller's propagation headers (W3C ``traceparent``,
    ``tracestate``, ``baggage``); ``deadline`` bounds all work done for the call.
    """

    request_id: str
    method: str
    deadline: Deadline
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __repr__(self) -> str:
        return (f"<RequestContext {self.method} id={self.request_id} "
                f"remaining={self.deadline.remaining_ms():.0f}ms>")


_current: contextvars.ContextVar[Optional[RequestContext]] = contextvars.ContextVar(
    "fanout_request", default=None)


def current_request() -> Optional[RequestContext]:
    """The :class:`RequestContext` of the RPC being served, or ``None`` outside one."""
    return _current.get()


@contextmanager
def use_request(request: RequestContext) -> Iterator[RequestContext]:
    """Make ``request`` current for the block (and for children spawned in it)."""
    token = _current.set(request)
    try:
        yield request
    finally:
        _current.reset(token)


def spawn_in_context(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Greenlet:
    """Start ``function`` in a new greenlet that runs in a copy of the caller's context."""
    context = contextvars.copy_context()
    return gevent.spawn(context.run, function, *args, **kwargs)


_Job = tuple  # (contextvars.Context, function, args)


class TaskRunners:
    """Reused greenlets, each running one function at a time in a copy of its starter's context.

    Why: starting a greenlet costs more than the rest of a short task (CPython 3.11+
    maps, then unmaps, a fresh frame stack for every new greenlet). A runner parks
    in the hub after each job and takes the next one, so a busy process creates
    greenlets only to grow. At most ``max_idle`` parked runners are kept.

    A job runs in the context copied by :meth:`start`, as with
    :func:`spawn_in_context`, so context variables never carry over from one job
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


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]
