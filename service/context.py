"""The request context, and spawning greenlets that keep it.

A new greenlet starts with an *empty* contextvars context, so a plain
``gevent.spawn`` would lose both the :class:`RequestContext` and the
OpenTelemetry current span. :func:`spawn_in_context` runs the child in a copy
of its parent's context instead; every child in this service is started that way.

Lookups read the request through one accessor, :func:`current_request`.
"""

from __future__ import annotations

import contextvars
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

import gevent
from gevent import Greenlet

from service.deadline import Deadline

__all__ = ["RequestContext", "current_request", "use_request", "spawn_in_context", "new_request_id"]


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


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]
