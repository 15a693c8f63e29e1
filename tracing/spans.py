"""The spans this service makes: one SERVER span per RPC, one INTERNAL span per fan-out task.

Both are cheap when nothing records them (tracing disabled or the trace not
sampled): attributes are only built for a recording span.

Spans an operator sees::

    AppStats/<method>           SERVER    rpc.system, rpc.service, rpc.method, fanout.request_id
      fanout.task <name>        INTERNAL  fanout.async, fanout.task.name, fanout.task.source,
                                          fanout.pool.wait_ms, fanout.task.status
        <pymongo / requests spans from the official instrumentations>
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

import gevent
from gevent import GreenletExit
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, format_trace_id

from tracing.propagation import extract_context

__all__ = ["RPC_SERVICE", "request_span", "task_span", "mark_task_outcome", "trace_id_hex"]

RPC_SERVICE = "AppStats"
_MAX_STATUS_DESCRIPTION = 200

# A proxy: it follows the global provider even if that is installed after import.
_tracer = trace.get_tracer("fanout")


@contextmanager
def request_span(method: str, headers: Mapping[str, str], request_id: str) -> Iterator[Span]:
    """Open the SERVER span for one RPC, a child of the caller's W3C context when ``headers`` carry one.

    The caller's context (with its baggage) and the span are current for the block.
    An exception escaping the block is recorded, sets status ERROR and is re-raised;
    control-flow exceptions (``gevent.Timeout``, ``GreenletExit``) pass through unrecorded.
    """
    parent = extract_context(headers)
    token = context_api.attach(parent) if parent else None
    try:
        # An explicit (possibly empty) parent: no traceparent means a new root, whatever is current.
        with _tracer.start_as_current_span(f"{RPC_SERVICE}/{method}", context=parent,
                                           kind=SpanKind.SERVER) as span:
            if span.is_recording():
                span.set_attributes({
                    "rpc.system": "apache_thrift", "rpc.service": RPC_SERVICE,
                    "rpc.method": method, "fanout.request_id": request_id,
                })
            yield span
    finally:
        if token is not None:
            context_api.detach(token)


@contextmanager
def task_span(name: str, source: str, pool_wait_ms: float) -> Iterator[Span]:
    """Open the INTERNAL span of one fan-out task, a child of the current span, current for the block.

    Run it in a greenlet started in a copy of the request's context, or it becomes
    a root of its own. Call :func:`mark_task_outcome` inside the block: the span ends
    with it. Exceptions pass through unchanged; if one escapes a span not yet marked,
    the span is marked for it (``ERROR``; ``TIMEOUT`` for ``gevent.Timeout``;
    ``CANCELLED`` for ``GreenletExit``).
    """
    span = _tracer.start_span(f"fanout.task {name}", kind=SpanKind.INTERNAL)
    if span.is_recording():
        span.set_attributes({
            "fanout.async": True, "fanout.task.name": name,
            "fanout.task.source": source, "fanout.pool.wait_ms": float(pool_wait_ms),
        })
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
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


def mark_task_outcome(span: Span, status: str, error: Optional[BaseException] = None) -> None:
    """Record a task's outcome (``"OK"``, ``"ERROR"``, ``"TIMEOUT"``, ...) on its span.

    With ``error`` the exception is recorded and the span status set to ERROR. Never raises.
    """
    if not span.is_recording():
        return
    span.set_attribute("fanout.task.status", status)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, _describe(error)))


def trace_id_hex(span: Span) -> str:
    """The span's trace id as 32 lowercase hex digits, or ``""`` when its context is invalid."""
    span_context = span.get_span_context()
    return format_trace_id(span_context.trace_id) if span_context.is_valid else ""


def _unmarked(span: Span) -> bool:
    attributes = getattr(span, "attributes", None)
    return span.is_recording() and attributes is not None and "fanout.task.status" not in attributes


def _describe(error: BaseException) -> str:
    text = str(error)
    description = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return description[:_MAX_STATUS_DESCRIPTION]
