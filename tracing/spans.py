"""The spans this service makes: one SERVER span per RPC, one INTERNAL span per fan-out
task; and the RPC server's metric beside them, by the same conventions.

Both are cheap when nothing records them (tracing disabled or the trace not
sampled): attributes are only built for a recording span, and a task span that
does not record is not even made current (it would change nothing anyone sees).
Under parent-based sampling (what ``tracing.sample_ratio`` configures; see
:func:`follow_parent_sampling`) an unsampled request goes further: no task span
is started at all, and the pymongo and requests instrumentations are suppressed
for the whole request, since every span they would make is unsampled too. Code
that calls another service must then pass the (unsampled) trace context on
itself, with :func:`tracing.context.inject_headers`: the requests
instrumentation no longer does it for such a request.

Failures are recorded as the standard ``exception`` event, with a stack trace of
file, line and function only (see :mod:`tracing.exceptions`).

Spans an operator sees (attributes by the semantic conventions the installed
OpenTelemetry packages define)::

    AppStats/<method>           SERVER    rpc.system.name, rpc.method, fanout.request_id,
                                          fanout.criticality (get_app_stats),
                                          server.address/port, client.address/port,
                                          network.peer.address/port, network.transport
      fanout.task <name>        INTERNAL  fanout.async, fanout.task.name, fanout.task.source,
                                          fanout.pool.wait_ms, fanout.task.status; a task not
                                          run: status SKIPPED, fanout.task.skip_reason
        <pymongo / requests spans from the official instrumentations, see tracing.clients>
    fanout.cache.timing <name>  INTERNAL  fanout.task.name, fanout.cache.timing (the plan): a
                                          cached panel's plan timed for no caller, a root
        <pymongo spans>

The metric, :class:`CallDurations`: ``rpc.server.call.duration``, one histogram
(seconds) over every call, from decoding to the reply written, with ``rpc.system.name``
(``apache_thrift``), ``rpc.method`` (``AppStats/<method>``) and, for calls answered with
an exception, ``error.type`` (the exception's name); in Prometheus
``rpc_server_call_duration_seconds_*``. A method the IDL does not declare is recorded as
``rpc.method`` ``_OTHER``, as the conventions ask: names a caller makes up must not make
series. Every call that was read is recorded once, its reply written or not (a reply
that could not be written has that failure as its ``error.type``).

A task the request stops waiting for (its deadline passed, or a required task
failed) has its span ended then, marked ``fanout.task.status`` ``TIMEOUT`` or
``CANCELLED`` with a ``fanout.task.cut`` event giving the reason (and status
ERROR for a deadline), so no task span outlasts its request's SERVER span. What
the abandoned task still does shows as its client spans running on past it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

import gevent
from gevent import GreenletExit
from opentelemetry import context as context_api
from opentelemetry import metrics, trace
from opentelemetry.semconv._incubating.metrics.rpc_metrics import create_rpc_server_call_duration
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, format_trace_id

from tracing.context import extract_context
from tracing.exceptions import MAX_STATUS_DESCRIPTION, record_error

__all__ = [
    "RPC_SERVICE",
    "RPC_SYSTEM",
    "rpc_attributes",
    "request_span",
    "task_span",
    "mark_task_outcome",
    "cut_task_span",
    "skipped_task_span",
    "timing_span",
    "mark_coalesced",
    "trace_id_hex",
    "follow_parent_sampling",
    "set_call_endpoints",
    "connection_endpoints",
    "CallDurations",
    "OTHER_METHOD",
]

RPC_SERVICE = "AppStats"
#: ``rpc.system.name`` of every Fanout call, as the conventions spelled it for Thrift.
RPC_SYSTEM = "apache_thrift"

# A proxy: it follows the global provider even if that is installed after import.
_tracer = trace.get_tracer("fanout")
# True once the installed sampler is known never to sample a child of an unsampled span.
_unsampled_is_final = False
#: ``rpc.method`` of a call to a method the IDL does not declare.
OTHER_METHOD = "_OTHER"
_call_duration = create_rpc_server_call_duration(metrics.get_meter("fanout.server"))
# The network attributes of the connection a call came in on; set by the server per call.
_NO_ENDPOINTS: Mapping[str, Any] = MappingProxyType({})
_call_endpoints: ContextVar[Mapping[str, Any]] = ContextVar(
    "fanout_call_endpoints", default=_NO_ENDPOINTS
)


def rpc_attributes(method: str) -> dict[str, str]:
    """``rpc.system.name`` and the fully qualified ``rpc.method`` (``AppStats/<method>``)."""
    return {"rpc.system.name": RPC_SYSTEM, "rpc.method": f"{RPC_SERVICE}/{method}"}


def set_call_endpoints(attributes: Mapping[str, Any]) -> None:
    """Declare, in the call's own context, the network attributes of its connection
    (``server.address``, ``client.address``, ...); :func:`request_span` adds them."""
    _call_endpoints.set(attributes)


def connection_endpoints(sock: socket.socket) -> Mapping[str, Any]:
    """The semantic conventions' network attributes of an accepted TCP connection."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:  # already reset by the peer: its calls will fail on their own
        return {}
    if not (isinstance(local, tuple) and isinstance(peer, tuple)):
        return {}
    return MappingProxyType(
        {
            "server.address": local[0],
            "server.port": local[1],
            "client.address": peer[0],
            "client.port": peer[1],
            "network.peer.address": peer[0],
            "network.peer.port": peer[1],
            "network.transport": "tcp",
        }
    )


def follow_parent_sampling(enabled: bool) -> None:
    """Declare whether the installed sampler never samples a span whose parent is unsampled.

    :func:`tracing.setup.configure_tracing` calls it for the global provider: true
    for parent-based samplers (and always-off). While true, an unsampled request
    skips its task spans and the instrumentations' spans, which nobody would record.
    """
    global _unsampled_is_final
    _unsampled_is_final = enabled


def _no_provider() -> bool:
    """True while no SDK tracer provider is installed: every span would be a no-op."""
    return isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def _unsampled(span: Span) -> bool:
    """True if nothing under ``span`` can be recorded: it belongs to an unsampled trace."""
    span_context = span.get_span_context()
    return _unsampled_is_final and span_context.is_valid and not span_context.trace_flags.sampled


@contextmanager
def request_span(method: str, headers: Mapping[str, str], request_id: str) -> Iterator[Span]:
    """Open the SERVER span for one RPC, a child of the caller's W3C context when ``headers`` carry
    one.

    The caller's context (with its baggage) and the span are current for the block.
    An exception escaping the block is recorded, sets status ERROR and is re-raised;
    control-flow exceptions (``gevent.Timeout``, ``GreenletExit``) pass through unrecorded.
    """
    parent = extract_context(headers)
    token = context_api.attach(parent) if parent else None
    if _no_provider():
        # Tracing is off: the caller's context is still current (it travels on to the
        # backends); making a span nobody records was a tenth of the cost of a refusal.
        try:
            yield trace.get_current_span()
        finally:
            if token is not None:
                context_api.detach(token)
        return
    try:
        # An explicit (possibly empty) parent: no traceparent means a new root, whatever is current.
        with _tracer.start_as_current_span(
            f"{RPC_SERVICE}/{method}",
            context=parent,
            kind=SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            if span.is_recording():
                span.set_attributes(
                    {
                        **rpc_attributes(method),
                        **_call_endpoints.get(),
                        "fanout.request_id": request_id,
                    }
                )
            try:
                if _unsampled(span):
                    # Imported here: the module loads ssl, which must wait for gevent's patching.
                    from opentelemetry.instrumentation.utils import suppress_instrumentation

                    with suppress_instrumentation():
                        yield span
                else:
                    yield span
            except Exception as error:
                record_error(span, error)
                raise
    finally:
        if token is not None:
            context_api.detach(token)


@contextmanager
def task_span(name: str, source: str, pool_wait_ms: float) -> Iterator[Span]:
    """Open the INTERNAL span of one fan-out task, a child of the current span, current for the
    block.

    Run it in a greenlet started in a copy of the request's context, or it becomes
    a root of its own. Call :func:`mark_task_outcome` inside the block: the span ends
    with it. Exceptions pass through unchanged; if one escapes a span not yet marked,
    the span is marked for it (``ERROR``; ``TIMEOUT`` for ``gevent.Timeout``;
    ``CANCELLED`` for ``GreenletExit``).
    """
    current = trace.get_current_span()
    if _unsampled(current):
        yield current  # a task span would not be sampled either: skip making one
        return
    span = _tracer.start_span(
        f"fanout.task {name}",
        kind=SpanKind.INTERNAL,
        attributes={
            "fanout.async": True,
            "fanout.task.name": name,
            "fanout.task.source": source,
            "fanout.pool.wait_ms": round(float(pool_wait_ms), 2),
        },
    )
    if not span.is_recording():
        # Tracing is off or the trace is not sampled. The request's span stays current,
        # so calls made in the task still pass the (unsampled) trace context on.
        yield span
        return
    # Made current as trace.use_span(span) makes it, without its layer of generator (the
    # task's outcome is marked below, never by use_span): every recorded call pays it.
    token = context_api.attach(trace.set_span_in_context(span))
    # Ended here unless cut_task_span ended it first, when the request stopped waiting.
    try:
        yield span
    except Exception as error:
        if _unmarked(span):
            mark_task_outcome(span, "ERROR", error)
        raise
    except gevent.Timeout as timeout:
        if _unmarked(span):
            mark_task_outcome(span, "TIMEOUT", timeout)
        raise
    except GreenletExit:
        if _unmarked(span):
            mark_task_outcome(span, "CANCELLED")
        raise
    finally:
        context_api.detach(token)
        if span.is_recording():
            span.end()


@contextmanager
def timing_span(panel: str, plan: str) -> Iterator[Span]:
    """Open the INTERNAL root span of one run of a cached panel's plan for no caller, to
    time it (``lookups/cache/plans.py``), current for the block: a trace of its own, as it
    is no part of any call. An exception is recorded on it and passes through."""
    with _tracer.start_as_current_span(
        f"fanout.cache.timing {panel}",
        context=context_api.Context(),
        kind=SpanKind.INTERNAL,
        attributes={"fanout.task.name": panel, "fanout.cache.timing": plan},
    ) as span:
        yield span


def skipped_task_span(name: str, source: str, reason: str) -> None:
    """The span of a task not run, under the current span: started and ended at once, with
    ``fanout.task.status`` ``SKIPPED`` and ``fanout.task.skip_reason`` (why: ``brownout``,
    ``disabled``)."""
    if _no_provider() or _unsampled(trace.get_current_span()):
        return
    _tracer.start_span(
        f"fanout.task {name}",
        kind=SpanKind.INTERNAL,
        attributes={
            "fanout.task.name": name,
            "fanout.task.source": source,
            "fanout.task.status": "SKIPPED",
            "fanout.task.skip_reason": reason,
        },
    ).end()


def mark_task_outcome(span: Span, status: str, error: BaseException | None = None) -> None:
    """Record a task's outcome (``"OK"``, ``"ERROR"``, ``"TIMEOUT"``, ...) on its span.

    With ``error`` the exception is recorded and the span status set to ERROR. Never raises.
    """
    if not span.is_recording():
        return
    span.set_attribute("fanout.task.status", status)
    if error is not None:
        record_error(span, error)


def cut_task_span(span: Span, status: str, reason: str) -> None:
    """End a task's span now: its request stopped waiting for it (``status`` ``TIMEOUT``
    or ``CANCELLED``, ``reason`` why). A ``TIMEOUT`` is an error: the caller got no value.

    The task may run on for a while (it is abandoned); its span keeps this outcome.
    Never raises; a span already ended is left alone.
    """
    if not span.is_recording():
        return
    span.set_attribute("fanout.task.status", status)
    span.add_event("fanout.task.cut", {"reason": reason})
    if status == "TIMEOUT":
        span.set_status(Status(StatusCode.ERROR, reason[:MAX_STATUS_DESCRIPTION]))
    span.end()


def mark_admitted(caller: str, weight: float) -> None:
    """Record on the current (SERVER) span the caller the call was admitted as, the
    principal its fair share counts it against (``anonymous`` for a call that names
    none), and that caller's weight."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({"fanout.caller": caller, "fanout.caller.weight": weight})


def mark_coalesced() -> None:
    """Mark the current (task) span as sharing an identical lookup's call in flight."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("fanout.task.coalesced", True)


def trace_id_hex(span: Span) -> str:
    """The span's trace id as 32 lowercase hex digits, or ``""`` when its context is invalid."""
    span_context = span.get_span_context()
    return format_trace_id(span_context.trace_id) if span_context.is_valid else ""


def _unmarked(span: Span) -> bool:
    attributes = getattr(span, "attributes", None)
    return span.is_recording() and attributes is not None and "fanout.task.status" not in attributes


class CallDurations:
    """Records ``rpc.server.call.duration`` for a server whose IDL declares ``methods``, in
    the process's call tally too if it keeps one (:mod:`tracing.call_tally`)."""

    def __init__(self, methods: Iterable[str]) -> None:
        self._declared = frozenset(methods)
        self._attributes: dict[tuple[str, str], dict[str, str]] = {}
        # Here, not at the top: the web tier's client imports this module, and must not
        # load the metrics SDK that the tally's bucket bounds come with.
        from tracing.call_tally import kept

        self._tally = kept()

    def call_ended(self, method: str, error_type: str, seconds: float) -> None:
        """Record one call; ``error_type`` is empty for a normal answer."""
        if method not in self._declared:
            method = OTHER_METHOD
        key = (method, error_type)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = rpc_attributes(method)
            if method == OTHER_METHOD:
                attributes["rpc.method"] = OTHER_METHOD
            if error_type:
                attributes["error.type"] = error_type
            if len(self._attributes) < 256:  # methods x exception types: a few dozen at most
                self._attributes[key] = attributes
        if self._tally is not None:
            self._tally.add(attributes["rpc.method"], error_type, seconds)
        _call_duration.record(seconds, attributes)
