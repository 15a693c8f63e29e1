"""HTTP client spans of our own, and the request duration (``tracing.http_spans = "own"``,
the default): each request a lookup sends, written to the stable HTTP conventions exactly
as the official requests instrumentation writes it, span and ``http.client.request.duration``
alike (a test holds them equal, ``tests/test_tracing_http_spans.py``).

The instrumentation wraps every ``Session.send`` and, once it is on, costs every request;
under tail capture every call records, so that cost is every call's. Ours is one context
manager around the lookup's send (:mod:`lookups.backends.http`). With ``"official"`` the
instrumentation makes them, and this module records nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import metrics, trace
from opentelemetry.propagate import inject
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.http import PARAMS_TO_REDACT, redact_url

from lookups.clock import Clock
from tracing.clients import PEER_SERVICE, URL_TEMPLATE, current_call

__all__ = ["http_request_span", "own_http_spans"]

_tracer = trace.get_tracer("fanout.clients")
#: Whether :func:`http_request_span` makes spans and the request duration: set by tracing's
#: set-up (``tracing.http_spans = "own"``).
_own_http_spans = False
# The histogram the requests instrumentation records, as it declares it (stable conventions).
_HTTP_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
_http_duration = metrics.get_meter("fanout.clients").create_histogram(
    "http.client.request.duration",
    unit="s",
    description="Duration of HTTP client requests.",
    explicit_bucket_boundaries_advisory=list(_HTTP_DURATION_BUCKETS),
)


def own_http_spans(on: bool) -> None:
    """Make HTTP client spans and ``http.client.request.duration`` of our own
    (``tracing.http_spans = "own"``) or not."""
    global _own_http_spans
    _own_http_spans = on


class _NoAnswer:
    """What :func:`http_request_span` yields when it records nothing."""

    def answered(self, response: Any) -> None:
        pass


_NO_ANSWER = _NoAnswer()


def http_request_span(
    request: Any, address: tuple[str, int | None], clock: Clock
) -> AbstractContextManager[Any]:
    """A CLIENT span for the ``request`` (a prepared ``requests`` request to ``address``)
    sent in this block (``address``: the URL's host, and its port if it names one), as the
    requests instrumentation writes one with the stable
    conventions: named ``METHOD route`` (:func:`remote_call`'s), with
    ``http.request.method``, ``url.full`` (credentials redacted), ``url.template``,
    ``user_agent.original``, ``server.address``/``server.port`` and the peer's,
    ``peer.service``; then ``http.response.status_code`` and ``network.protocol.version``
    (call ``answered(response)`` on what it yields), and ``error.type`` with status ERROR for
    a status of 400 or more or an exception. The span's trace context is put in the
    request's headers. ``http.client.request.duration`` is recorded for every request,
    recording span or not, while our own spans are on, as ``clock`` times it."""
    if not _own_http_spans:
        return nullcontext(_NO_ANSWER)
    return _request_span(request, address, clock)


#: ``network.protocol.version`` by urllib3's version number of the answer.
_PROTOCOL_VERSIONS = {10: "1.0", 11: "1.1", 20: "2"}


class _Answer:
    __slots__ = ("status", "version")

    def __init__(self) -> None:
        self.status = 0
        self.version = ""

    def answered(self, response: Any) -> None:
        self.status = response.status_code
        raw = getattr(response, "raw", None)
        self.version = _PROTOCOL_VERSIONS.get(getattr(raw, "version", 0), "")


@contextmanager
def _request_span(request: Any, address: tuple[str, int | None], clock: Clock) -> Iterator[_Answer]:
    method = request.method
    metric: dict[str, Any] = {"http.request.method": method, "server.address": address[0]}
    if address[1]:
        metric["server.port"] = address[1]
    span = _http_span(request, method, address)
    answer, began = _Answer(), clock.monotonic()
    try:
        if span is None:
            yield answer
        else:
            # Current as trace.use_span(span) makes it, without its layer of generator.
            token = context_api.attach(trace.set_span_in_context(span))
            try:
                inject(request.headers)
                yield answer
            finally:
                context_api.detach(token)
    except Exception as error:
        metric["error.type"] = type(error).__qualname__
        if span is not None:
            span.set_attribute("error.type", metric["error.type"])
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__qualname__}: {error}"))
        raise
    finally:
        if answer.status:
            metric["http.response.status_code"] = answer.status
            if answer.status >= 400:
                metric["error.type"] = str(answer.status)
            if answer.version:
                metric["network.protocol.version"] = answer.version
        if span is not None:
            _answered(span, metric)
        _http_duration.record(clock.monotonic() - began, metric)


def _http_span(request: Any, method: str, address: tuple[str, int | None]) -> trace.Span | None:
    if not trace.get_current_span().is_recording():
        return None
    call = current_call()
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.full": _full_url(request.url),
        "user_agent.original": request.headers.get("User-Agent", ""),
        "server.address": address[0],
        "network.peer.address": address[0],
    }
    if address[1]:
        attributes["server.port"] = attributes["network.peer.port"] = address[1]
    name = method
    if call is not None:
        attributes[PEER_SERVICE] = call[0]
        if call[1]:
            attributes[URL_TEMPLATE] = call[1]
            name = f"{method} {call[1]}"
    return _tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def _full_url(url: str) -> str:
    """``url.full`` as the requests instrumentation writes it (:func:`redact_url`: no
    credentials, no signature parameters), without parsing a URL that holds nothing to
    redact: no ``@``, no parameter name it redacts, no escape that could spell one. The
    parse was most of an HTTP span's recording, paid by every call tail capture records."""
    if "@" in url or "%" in url or any(name in url for name in PARAMS_TO_REDACT):
        return redact_url(url)
    return url


def _answered(span: trace.Span, metric: dict[str, Any]) -> None:
    status = metric.get("http.response.status_code")
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_attribute("error.type", metric["error.type"])
            span.set_status(Status(StatusCode.ERROR))
    if "network.protocol.version" in metric:
        span.set_attribute("network.protocol.version", metric["network.protocol.version"])
    span.end()
