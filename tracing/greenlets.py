"""Starting greenlets that keep the caller's context, and with it the current span.

A new greenlet starts with an *empty* contextvars context, so a plain
``gevent.spawn`` loses the OpenTelemetry current span (and every other context
variable): spans started in the child become roots of new traces.
:func:`spawn_in_context` runs the child in a copy of its parent's context
instead. Every greenlet Fanout starts goes through it (or through the engine's
task runners, which copy the context the same way); a lookup that starts
greenlets of its own should too.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import gevent
from gevent import Greenlet

__all__ = ["spawn_in_context"]


def spawn_in_context(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Greenlet:
    """Start ``function`` in a new greenlet that runs in a copy of the caller's context."""
    context = contextvars.copy_context()
    return gevent.spawn(context.run, function, *args, **kwargs)
