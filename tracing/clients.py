"""Client spans a reader can tell apart, naming the service they call.

The MongoDB command spans are Fanout's own by default (``tracing.mongo_spans = "own"``,
:func:`mongo_command_span`): each command a lookup sends, written to the stable
database conventions exactly as the official pymongo instrumentation writes them. That
instrumentation listens to pymongo's command monitoring, and pymongo builds the events
for every command once a listener is registered, sampled or not; a command of our own
costs nothing outside a recording span. With ``"official"`` the instrumentation makes
them; the HTTP ones are ours too (:mod:`tracing.http_spans`) unless the requests
instrumentation makes them. The names and hooks here finish all of them so a trace view
shows what each one is:

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
instrumentations, :func:`remote_call` only sets a context variable, and
:func:`mongo_command_span` makes a span only while our own are on and the span
current is recording.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pymongo import monitoring
from pymongo.errors import OperationFailure

__all__ = [
    "MONGODB_SERVICE",
    "mongo_command_span",
    "own_mongo_spans",
    "current_call",
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
_tracer = trace.get_tracer("fanout.clients")
#: Whether :func:`mongo_command_span` makes spans: set by tracing's set-up (own spans on).
_own_mongo_spans = False


def own_mongo_spans(on: bool) -> None:
    """Make MongoDB command spans of our own (``tracing.mongo_spans = "own"``) or not."""
    global _own_mongo_spans
    _own_mongo_spans = on


def mongo_command_span(
    command: str, database: str, collection: str, client: Any
) -> AbstractContextManager[None]:
    """A CLIENT span for one command sent in this block, as the pymongo instrumentation
    writes one with the stable conventions: named ``command collection``, with
    ``db.system.name``, ``db.namespace``, ``db.query.text`` (the command's name, never its
    values), ``db.collection.name``, ``server.address``/``server.port`` and
    ``peer.service``; a command the server fails gets an ERROR status with its message
    and ``error.type``, its code name (``UnknownError`` without one). The server is the
    one ``client`` (a ``MongoClient``) knows once the command is over, when it can tell
    which: its only one, or the primary. Nothing is made unless our own spans are on
    and the current span records."""
    if not _own_mongo_spans or not trace.get_current_span().is_recording():
        return _NO_SPAN  # the usual case: no generator made for every command
    return _command_span(command, database, collection, client)


_NO_SPAN: AbstractContextManager[None] = nullcontext()


@contextmanager
def _command_span(command: str, database: str, collection: str, client: Any) -> Iterator[None]:
    call = _current_call.get()
    attributes: dict[str, Any] = {
        "db.system.name": "mongodb",
        "db.namespace": database,
        "db.query.text": command,
        "db.collection.name": collection,
        PEER_SERVICE: call[0] if call is not None else MONGODB_SERVICE,
    }
    # Not made current: a connection pymongo opens or checks out for the command shows on
    # the task's span, as with the instrumentation, whose span starts after the check-out.
    span = _tracer.start_span(
        f"{command} {collection}", kind=SpanKind.CLIENT, attributes=attributes
    )
    try:
        yield
    except Exception as failed:
        details = failed.details if isinstance(failed, OperationFailure) else None
        failure = details if isinstance(details, dict) else {"errmsg": str(failed)}
        span.set_status(Status(StatusCode.ERROR, str(failure.get("errmsg", "Unknown error"))))
        span.set_attribute("error.type", str(failure.get("codeName", "UnknownError")))
        raise
    finally:
        address = _server_of(client)
        if address is not None:
            span.set_attribute("server.address", address[0])
            span.set_attribute("server.port", address[1])
        span.end()


def _server_of(client: Any) -> tuple[str, int] | None:
    """The server ``client``'s commands go to, when its topology says without a selection:
    its only known server, else its primary; None while it knows neither."""
    known = client.topology_description.known_servers
    if len(known) == 1:
        address: tuple[str, int] = known[0].address
        return address
    primaries = [server.address for server in known if server.is_writable]
    return primaries[0] if len(primaries) == 1 else None


def current_call() -> tuple[str, str] | None:
    """The remote call :func:`remote_call` named for this block: service and route."""
    return _current_call.get()


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
