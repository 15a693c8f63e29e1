"""Client spans a reader can tell apart, naming the service they call.

The official pymongo and requests instrumentations make the CLIENT spans; the
hooks here finish them so a trace view shows what each one is:

* names by the semantic conventions: ``GET /apps/{app}/alerts`` (method and
  ``url.template``) instead of ``GET``; ``aggregate errors`` (operation and
  collection) instead of ``apm.aggregate``;
* ``peer.service``, the logical name of the remote service (``mongodb``,
  ``alerts``, ``metrics``), which trace views such as Zipkin need for their
  dependency graph, beside the ``server.address`` / ``server.port`` the
  instrumentations set;
* MongoDB connection set-up and pool check-out as events on the calling span, so
  the time before a command's span (the first call after start, a saturated
  pool) is visible and explained.

A lookup names the call it is about to make with :func:`remote_call`::

    with remote_call("alerts", "/apps/{app}/alerts"):
        session.get(url, ...)

Nothing here runs when tracing is off: the hooks are installed with the
instrumentations, and :func:`remote_call` only sets a context variable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from pymongo import monitoring

__all__ = [
    "MONGODB_SERVICE",
    "remote_call",
    "requests_request_hook",
    "pymongo_request_hook",
    "MongoConnectionEvents",
]

#: ``peer.service`` of MongoDB commands unless a lookup names the call otherwise.
MONGODB_SERVICE = "mongodb"
PEER_SERVICE = "peer.service"
URL_TEMPLATE = "url.template"
# Check-outs and set-ups quicker than this leave no event: only the ones a reader would ask about.
_NOTABLE_MS = 1.0

_current_call: ContextVar[tuple[str, str] | None] = ContextVar("fanout_remote_call", default=None)


@contextmanager
def remote_call(service: str, route: str = "") -> Iterator[None]:
    """Name the remote call made in this block: the service's logical name and, for HTTP,
    the route template (``/apps/{app}/alerts``), which must not hold values of the call."""
    token = _current_call.set((service, route))
    try:
        yield
    finally:
        _current_call.reset(token)


def requests_request_hook(span: trace.Span, request: Any) -> None:
    """For the requests instrumentation: name the span ``METHOD /route/{template}``."""
    call = _current_call.get()
    if call is None or not span.is_recording():
        return
    service, route = call
    span.set_attribute(PEER_SERVICE, service)
    if route:
        span.set_attribute(URL_TEMPLATE, route)
        span.update_name(f"{request.method} {route}")


def pymongo_request_hook(span: trace.Span, event: monitoring.CommandStartedEvent) -> None:
    """For the pymongo instrumentation: name the span ``operation collection``."""
    if not span.is_recording():
        return
    call = _current_call.get()
    span.set_attribute(PEER_SERVICE, call[0] if call is not None else MONGODB_SERVICE)
    collection = event.command.get(event.command_name)
    if isinstance(collection, str) and collection:
        span.update_name(f"{event.command_name} {collection}")


class MongoConnectionEvents(monitoring.ConnectionPoolListener):
    """Connection set-up and slow pool check-outs, as events on the span current at the time.

    pymongo publishes these in the greenlet that checks the connection out, before
    the command (and its span) starts, so the span current then is the task's.
    Connections opened in pymongo's background threads have no span and leave none.
    """

    def connection_created(self, event: monitoring.ConnectionCreatedEvent) -> None:
        _add_event("mongodb.connection.created", {"server.address": _address(event.address)})

    def connection_ready(self, event: monitoring.ConnectionReadyEvent) -> None:
        _add_event("mongodb.connection.ready", {"duration_ms": _ms(event)}, always=True)

    def connection_checked_out(self, event: monitoring.ConnectionCheckedOutEvent) -> None:
        _add_event("mongodb.connection.checkout", {"duration_ms": _ms(event)})

    def connection_check_out_failed(self, event: monitoring.ConnectionCheckOutFailedEvent) -> None:
        _add_event(
            "mongodb.connection.checkout_failed",
            {"reason": str(event.reason), "duration_ms": _ms(event)},
            always=True,
        )

    # The rest of the listener interface says nothing a request's trace needs.
    def pool_created(self, event: Any) -> None:
        pass

    def pool_ready(self, event: Any) -> None:
        pass

    def pool_cleared(self, event: Any) -> None:
        pass

    def pool_closed(self, event: Any) -> None:
        pass

    def connection_closed(self, event: Any) -> None:
        pass

    def connection_check_out_started(self, event: Any) -> None:
        pass

    def connection_checked_in(self, event: Any) -> None:
        pass


def _add_event(name: str, attributes: dict[str, Any], *, always: bool = False) -> None:
    span = trace.get_current_span()
    if not span.is_recording():
        return
    duration = attributes.get("duration_ms")
    if always or duration is None or duration >= _NOTABLE_MS:
        span.add_event(name, attributes)


def _ms(event: Any) -> float:
    # ``duration`` (seconds) is in pymongo 4.7 and later.
    return round(float(getattr(event, "duration", 0.0) or 0.0) * 1000.0, 2)


def _address(address: Any) -> str:
    host, port = address if isinstance(address, tuple) else (address, "")
    return f"{host}:{port}" if port else str(host)
