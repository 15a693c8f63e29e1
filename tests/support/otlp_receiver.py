"""A real OTLP/HTTP receiver on a free loopback port: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest``, each span kept as plain values.

    with OtlpReceiver() as receiver:
        ... # a server exporting to receiver.endpoint
        spans = receiver.wait_for(lambda spans: len(spans) >= 15)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Self

import gevent
from gevent.pywsgi import WSGIServer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

__all__ = ["OtlpReceiver", "attributes_of"]


def attributes_of(key_values: Any) -> dict[str, Any]:
    """OTLP ``KeyValue`` list as a dict of plain values."""
    return {item.key: getattr(item.value, item.value.WhichOneof("value")) for item in key_values}


class OtlpReceiver:
    """Every span received, as a dict: name, kind, ids (hex), attributes, events, status."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._server = WSGIServer(("127.0.0.1", 0), self._application, log=None, error_log=None)

    @property
    def endpoint(self) -> str:
        """The base URL (``tracing.endpoint``)."""
        return f"http://127.0.0.1:{self._server.server_port}"

    def wait_for(
        self, enough: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 20.0
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not enough(self.spans):
            assert time.monotonic() < deadline, f"{len(self.spans)} spans only: {self.spans[:3]}"
            gevent.sleep(0.05)
        return list(self.spans)

    def _application(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["REQUEST_METHOD"] != "POST" or environ["PATH_INFO"] != "/v1/traces":
            start_response("404 Not Found", [("Content-Length", "0")])
            return [b""]
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(_plain(span) for span in scope_spans.spans)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        start_response(
            "200 OK",
            [("Content-Type", "application/x-protobuf"), ("Content-Length", str(len(reply)))],
        )
        return [reply]

    def __enter__(self) -> Self:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop(timeout=2)


def _plain(span: Any) -> dict[str, Any]:
    return {
        "name": span.name,
        "kind": span.kind,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "attributes": attributes_of(span.attributes),
        "events": [event.name for event in span.events],
        "links": len(span.links),
        "status": span.status.code,
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
    }
