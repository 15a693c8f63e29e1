"""The caller's context, carried on: across the Thrift hop, and into every greenlet.

**Across the hop.** The caller's W3C ``traceparent``/``tracestate`` and ``baggage``
travel in ``RequestMeta.headers``. They come from outside, so :func:`extract_context`
trusts nothing: header names are matched without regard to case, over-long values
are dropped, and anything the propagator cannot parse gives a fresh root context
instead of an exception.

**Into greenlets.** A new greenlet starts with an *empty* contextvars context, so a
plain ``gevent.spawn`` loses the OpenTelemetry current span (and every other context
variable): spans started in the child become roots of new traces.
:func:`spawn_in_context` runs the child in a copy of its parent's context instead,
and :class:`TaskRunners` (the engine's reused greenlets) runs each job in a copy of
its starter's. Every greenlet Fanout starts goes through one of them; a lookup that
starts greenlets of its own should too.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import gevent
from gevent import Greenlet
from gevent.hub import get_hub
from greenlet import getcurrent
from greenlet import greenlet as RawGreenlet
from opentelemetry import propagate
from opentelemetry.context import Context

__all__ = [
    "MAX_HEADER_CHARS",
    "MAX_HEADERS",
    "extract_context",
    "inject_headers",
    "propagation_fields",
    "spawn_in_context",
    "TaskRunners",
]

# W3C caps tracestate at 32 members (~512 chars useful) and baggage at 8192 bytes;
# anything longer is not a header a well-behaved caller sends.
MAX_HEADER_CHARS = 8192
# Only this many header entries are looked at; the rest cannot hold trace context we honour.
MAX_HEADERS = 64

_log = logging.getLogger(__name__)


def extract_context(headers: Mapping[str, str]) -> Context:
    """The context the caller's ``headers`` describe, or an empty (root) context.

    Never raises for bad input: malformed, over-long or non-string values are ignored.
    """
    if not headers:
        return Context()
    try:
        carrier = _trace_headers(headers)
        return propagate.extract(carrier, context=Context()) if carrier else Context()
    except Exception:  # noqa: BLE001 - a caller's junk must never fail the request
        _log.debug("ignoring unparseable trace-context headers", exc_info=True)
        return Context()


def inject_headers() -> dict[str, str]:
    """The current trace context (and baggage) as a fresh dict of propagation headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def propagation_fields() -> frozenset[str]:
    """The header names the configured propagators read, lower-case.

    W3C ``traceparent``, ``tracestate`` and ``baggage`` by default; others when
    ``OTEL_PROPAGATORS`` names other propagators (b3, jaeger, ...).
    """
    return frozenset(field.lower() for field in propagate.get_global_textmap().fields)


def _trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The propagator's own fields from ``headers``, lower-cased, with sane values only."""
    wanted = propagation_fields()
    carrier: dict[str, str] = {}
    for count, (name, value) in enumerate(headers.items()):
        if count >= MAX_HEADERS:
            break
        if not isinstance(name, str) or not isinstance(value, str) or len(value) > MAX_HEADER_CHARS:
            continue
        lowered = name.lower()
        if lowered in wanted:
            carrier[lowered] = value
    return carrier


def spawn_in_context(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Greenlet:
    """Start ``function`` in a new greenlet that runs in a copy of the caller's context."""
    context = contextvars.copy_context()
    return gevent.spawn(context.run, function, *args, **kwargs)


_Job = tuple[Any, ...]  # (contextvars.Context, function, args)


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

    def _serve(self, first: _Job) -> None:
        me, hub = getcurrent(), get_hub()
        job: _Job | None = first
        while job is not None:
            context, function, args = job
            try:
                context.run(function, *args)
            except Exception:  # noqa: BLE001 - reported to the hub, as a greenlet's own failure is
                hub.handle_error(me, *sys.exc_info())
            job = context = function = args = None  # a parked runner holds nothing of its job
            if len(self._idle) >= self._max_idle:
                return
            self._idle.append(me)
            job = self._park(me, hub)

    def _park(self, me: RawGreenlet, hub: Any) -> _Job | None:
        """Wait in the hub for the next job; ``None`` if woken by anything but :meth:`_resume`."""
        woken_by_start = False
        try:
            job = hub.switch()
            woken_by_start = type(job) is tuple and len(job) == 3
        finally:
            if not woken_by_start and me in self._idle:
                self._idle.remove(me)
        if not woken_by_start:
            _log.warning("a parked task runner was woken by %r; ending it", job)
            return None
        started: _Job = job
        return started
