"""Spans leave over the wire: real OTLP/HTTP and OTLP/gRPC receivers in-process, on 127.0.0.1 port 0."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import gevent
import grpc
import pytest
from gevent.pywsgi import WSGIServer
from gevent.queue import Empty, Queue
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind

from lookups.backends.http import HttpBackend
from lookups.backends.settings import HttpBackendSettings
from lookups.deadline import Deadline
from lookups.errors import LookupFailed
from tests.support.tracing import provider_of
from tracing.exporters import prepare_grpc_for_gevent
from tracing.settings import TracingSettings
from tracing.setup import Tracing, configure_tracing
from tracing.spans import request_span, task_span

RECEIVE_TIMEOUT_S = 10


class Received:
    """What a receiver got: decoded export requests, one per call, plus the HTTP paths asked for."""

    def __init__(self) -> None:
        self.requests: Queue = Queue()
        self.paths: list[str] = []
        self.delay_s = 0.0

    def spans(self) -> dict[str, dict[str, Any]]:
        """Every span of the next export request, by name, as plain values."""
        try:
            request = self.requests.get(timeout=RECEIVE_TIMEOUT_S)
        except Empty:
            pytest.fail(f"no export request arrived within {RECEIVE_TIMEOUT_S} s")
        found = {}
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found[span.name] = {
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "kind": span.kind,
                        "attributes": _attributes(span.attributes),
                        "resource": resource,
                    }
        return found


def _attributes(key_values) -> dict[str, Any]:
    return {item.key: getattr(item.value, item.value.WhichOneof("value")) for item in key_values}


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest body."""
    received = Received()

    def application(environ, start_response):
        received.paths.append(environ["PATH_INFO"])
        if environ["REQUEST_METHOD"] != "POST" or environ["PATH_INFO"] != "/v1/traces":
            start_response("404 Not Found", [("Content-Length", "0")])
            return [b""]
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        gevent.sleep(received.delay_s)
        received.requests.put(ExportTraceServiceRequest.FromString(body))
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        start_response(
            "200 OK",
            [("Content-Type", "application/x-protobuf"), ("Content-Length", str(len(reply)))],
        )
        return [reply]

    server = WSGIServer(("127.0.0.1", 0), application, log=None, error_log=None)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", received
    finally:
        server.stop(timeout=2)


@pytest.fixture
def configure() -> Iterator[Any]:
    """configure_tracing for standalone providers, each shut down after the test."""
    handles: list[Tracing] = []

    def _configure(env: Mapping[str, str] | None = None, **settings: Any) -> Tracing:
        handle = configure_tracing(
            TracingSettings(service_name="export-test", **settings), set_global=False, env=env or {}
        )
        handles.append(handle)
        return handle

    yield _configure
    for handle in handles:
        handle.shutdown()


@contextmanager
def ticking() -> Iterator[list[float]]:
    """Count 10 ms ticks of another greenlet for the block: a blocked hub stops them."""
    ticks: list[float] = []

    def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            gevent.sleep(0.01)

    clock = gevent.spawn(ticker)
    try:
        yield ticks
    finally:
        clock.kill()


def make_trace(handle: Tracing) -> None:
    tracer = provider_of(handle).get_tracer("export-test")
    with tracer.start_as_current_span(
        "AppStats/getStats", kind=SpanKind.SERVER, attributes={"rpc.method": "getStats"}
    ):
        with tracer.start_as_current_span(
            "fanout.task errors", attributes={"fanout.async": True, "fanout.pool.wait_ms": 0.5}
        ):
            pass


def assert_trace_arrived(spans: dict[str, dict[str, Any]]) -> None:
    server, task = spans["AppStats/getStats"], spans["fanout.task errors"]
    assert task["trace_id"] == server["trace_id"]
    assert task["parent_span_id"] == server["span_id"]
    assert server["parent_span_id"] == ""
    assert server["attributes"] == {"rpc.method": "getStats"}
    assert task["attributes"] == {"fanout.async": True, "fanout.pool.wait_ms": 0.5}
    assert server["resource"]["service.name"] == "export-test"


def test_otlp_http_export_through_the_batch_processor(configure, http_receiver) -> None:
    url, received = http_receiver
    handle = configure(exporter="otlp", otlp_protocol="http/protobuf", endpoint=url)
    make_trace(handle)
    assert handle.force_flush(10_000)
    assert_trace_arrived(received.spans())
    assert received.paths == ["/v1/traces"]


@pytest.mark.parametrize(
    "env_name, suffix",
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "/v1/traces"),
    ],
)
def test_otlp_http_endpoint_from_otel_env(configure, http_receiver, env_name, suffix) -> None:
    url, received = http_receiver
    handle = configure({env_name: url + suffix})
    make_trace(handle)
    assert handle.force_flush(10_000)
    assert_trace_arrived(received.spans())


def test_batch_worker_exports_on_its_own_without_blocking_the_hub(
    configure, http_receiver, monkeypatch
) -> None:
    url, received = http_receiver
    received.delay_s = 0.5
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    handle = configure(exporter="otlp", endpoint=url)
    with ticking() as ticks:
        make_trace(handle)
        spans = received.spans()  # no flush: the batch worker greenlet sends on its schedule
    assert_trace_arrived(spans)
    # The receiver held the export for 0.5 s; a hub blocked by it would have ticked a handful of times.
    assert len(ticks) >= 15, len(ticks)


def test_the_exporters_own_http_calls_are_not_traced(configure, http_receiver, spans) -> None:
    url, received = http_receiver
    # Contrast first: a lookup's request under a task span is a CLIENT span.
    backend = HttpBackend("alerts", HttpBackendSettings(url=url))
    with request_span("getStats", {}, "req-contrast"), task_span("alerts", "http", 0):
        with contextlib.suppress(LookupFailed):  # the receiver answers 404
            backend._get_body("alerts", url + "/elsewhere", {}, "", Deadline.after_s(5))
    backend.close()
    assert SpanKind.CLIENT in [span.kind for span in spans.get_finished_spans()]
    spans.clear()
    handle = configure(exporter="otlp", endpoint=url)
    make_trace(handle)
    assert handle.force_flush(10_000)
    assert_trace_arrived(received.spans())
    assert spans.get_finished_spans() == ()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request, context):
        gevent.sleep(self.received.delay_s)
        self.received.requests.put(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_grpc_export_under_gevent(configure) -> None:
    # gRPC must be readied for gevent before its first object, here the receiving server.
    prepare_grpc_for_gevent()
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        handle = configure(
            exporter="otlp", otlp_protocol="grpc", endpoint=f"http://127.0.0.1:{port}"
        )
        received.delay_s = 0.5
        make_trace(handle)
        with ticking() as ticks:
            assert handle.force_flush(10_000)
        assert_trace_arrived(received.spans())
        # The export waited 0.5 s on the receiver; other greenlets must have run meanwhile.
        assert len(ticks) >= 15, len(ticks)
    finally:
        server.stop(grace=None).wait(5)


def test_an_exporter_that_cannot_export_is_said_once_and_again_when_it_can(caplog: Any) -> None:
    """A real collector refusing every batch (HTTP 400, which the exporter does not retry),
    then taking them: the exporter's own line and one WARNING for the outage, nothing for
    the batches after, and one INFO when a batch goes through again."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider

    from tracing.export_outages import ReportedExporter

    status = ["400 Bad Request"]

    def application(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        environ["wsgi.input"].read()
        start_response(status[0], [("Content-Type", "application/x-protobuf")])
        return [b""]

    server = WSGIServer(("127.0.0.1", 0), application, log=None, error_log=None)
    server.start()
    endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
    exporter = ReportedExporter(OTLPSpanExporter(endpoint=endpoint), "the collector")
    tracer = TracerProvider().get_tracer("test")
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(5):
                span = tracer.start_span("batch")
                span.end()
                exporter.export([span])  # type: ignore[list-item]
            status[0] = "200 OK"
            span = tracer.start_span("batch")
            span.end()
            exporter.export([span])  # type: ignore[list-item]
    finally:
        exporter.shutdown()
        server.stop()
    said = [(r.name, r.levelname) for r in caplog.records]
    assert said == [
        ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "ERROR"),
        ("tracing.export_outages", "WARNING"),
        ("tracing.export_outages", "INFO"),
    ], [r.getMessage() for r in caplog.records]
    assert "(5 batches failed meanwhile)" in caplog.records[-1].getMessage()
