"""Our own HTTP client spans and request duration (:mod:`tracing.http_spans`) against the
official requests instrumentation's, for the same requests of a real HTTP backend to a real
local server: the same names, kinds, attributes, statuses and events, and the same
``http.client.request.duration`` points, for an answer, a 500 and a refused connection;
and the trace context the server is sent names our span."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gevent.pywsgi import WSGIServer
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util.http import redact_url

import tracing.http_spans as http_spans
from lookups.backends.http import HttpBackend
from lookups.backends.settings import HttpBackendSettings
from lookups.deadline import Deadline
from tests.support.sockets import dead_port
from tracing.clients import requests_request_hook
from tracing.http_spans import own_http_spans

ROUTE = "/apps/{app}/alerts"


class Side:
    """A tracer and a meter provider of their own, and what they recorded."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])

    def points(self) -> list[dict[str, Any]]:
        data = self.reader.get_metrics_data()
        return [
            dict(point.attributes or {})
            for resource in (data.resource_metrics if data else ())
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "http.client.request.duration"
            for point in metric.data.data_points
        ]


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[int, list[str]]]:
    """A local HTTP server: 200 for the alerts route, 500 for ``/fail``; the traceparents."""
    seen: list[str] = []

    def application(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append(environ.get("HTTP_TRACEPARENT", ""))
        failing = environ["PATH_INFO"].startswith("/fail")
        start_response("500 Oops" if failing else "200 OK", [("Content-Type", "text/plain")])
        return [b"{}"]

    server = WSGIServer(("127.0.0.1", 0), application, log=None, error_log=None)
    server.start()
    try:
        yield server.server_port, seen
    finally:
        server.stop(timeout=2)


def _requests(port: int, dead: int) -> list[tuple[HttpBackend, str]]:
    def backend(at: int) -> HttpBackend:
        return HttpBackend("alerts", HttpBackendSettings(url=f"http://127.0.0.1:{at}"))

    return [
        (backend(port), "/apps/shop/alerts"),
        (backend(port), "/fail/shop"),
        (backend(dead), "/apps/shop/alerts"),
    ]


def _traced(port: int, dead: int, side: Side, ours: bool) -> tuple[list[Any], list[dict[str, Any]]]:
    tracer = side.provider.get_tracer("test")
    saved = http_spans._tracer, http_spans._http_duration
    if ours:
        http_spans._tracer = side.provider.get_tracer("fanout.clients")
        http_spans._http_duration = side.meters.get_meter("fanout.clients").create_histogram(
            "http.client.request.duration", unit="s"
        )
    else:
        own_http_spans(False)
        RequestsInstrumentor().instrument(
            tracer_provider=side.provider,
            meter_provider=side.meters,
            request_hook=requests_request_hook,
        )
    try:
        for backend, path in _requests(port, dead):
            with tracer.start_as_current_span("task"):
                try:
                    backend._get_body(
                        "alerts", backend._base + path, {"start_ms": 1}, ROUTE, Deadline.after_s(5)
                    )
                except Exception:
                    pass
            backend.close()
    finally:
        http_spans._tracer, http_spans._http_duration = saved
        if not ours:
            RequestsInstrumentor().uninstrument()
        own_http_spans(True)
    spans = [s for s in side.exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    return spans, side.points()


def _shape(span: Any) -> tuple[Any, ...]:
    attributes = dict(span.attributes)
    return (
        span.name,
        span.kind,
        attributes,
        span.status.status_code,
        (span.status.description or "").split(":")[0],
        [event.name for event in span.events],
    )


def test_our_http_spans_and_durations_are_the_official_instrumentations(
    service: tuple[int, list[str]],
) -> None:
    port, seen = service
    dead = dead_port()  # the same on both sides: it is in the attributes
    official_spans, official_points = _traced(port, dead, Side(), ours=False)
    seen.clear()
    our_spans, our_points = _traced(port, dead, Side(), ours=True)
    assert len(official_spans) == len(our_spans) == 3
    for theirs, mine in zip(official_spans, our_spans):
        assert _shape(mine) == _shape(theirs)
    assert sorted(map(str, our_points)) == sorted(map(str, official_points))
    # The two answered requests were told our span's context.
    answered = [span for span in our_spans if "http.response.status_code" in span.attributes]
    assert [t.split("-")[2] for t in seen] == [f"{s.context.span_id:016x}" for s in answered]


@given(
    st.sampled_from(["http", "https"]),
    st.sampled_from(["", "user:secret@", "u@"]),
    st.sampled_from(["127.0.0.1:8080", "metrics.internal"]),
    st.sampled_from(["/apps/shop/alerts", "/apps/sh%2Fop/series/latency", "/"]),
    st.lists(
        st.tuples(
            st.sampled_from(["start_ms", "sig", "Signature", "%53ignature", "AWSAccessKeyId", "x"]),
            st.sampled_from(["1", "abc", "a%20b"]),
        ),
        max_size=3,
    ),
)
def test_url_full_is_what_the_instrumentations_redaction_gives(
    scheme: str, userinfo: str, host: str, path: str, params: list[tuple[str, str]]
) -> None:
    """The shortcut past a URL with nothing to redact gives exactly redact_url's answer."""
    query = "&".join(f"{name}={value}" for name, value in params)
    url = f"{scheme}://{userinfo}{host}{path}" + (f"?{query}" if query else "")
    assert http_spans._full_url(url) == redact_url(url)
