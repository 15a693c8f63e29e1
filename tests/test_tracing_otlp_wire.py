"""tracing.otlp_wire writes the same OTLP export request as the SDK's encoder, for any span."""

from __future__ import annotations

import types
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from tests.support.tracing import provider_of
from tracing.otlp_wire import encode_spans, use_for_http_export
from tracing.settings import TracingSettings
from tracing.setup import configure_tracing

INT64 = 2**63
texts = st.text(max_size=12)
scalars = st.one_of(
    texts,
    st.booleans(),
    st.integers(-2 * INT64, 2 * INT64),
    st.floats(allow_nan=False),
    st.binary(max_size=6),
)
values = st.one_of(
    scalars,
    st.lists(texts, max_size=3),
    st.lists(st.booleans(), max_size=3),
    st.lists(st.integers(-INT64, INT64 - 1), max_size=3),
    st.lists(st.floats(allow_nan=False), max_size=3),
)
attributes = st.dictionaries(st.text(max_size=8), values, max_size=5)
trace_states = st.lists(
    st.tuples(st.sampled_from(["a", "vendor", "k9"]), st.sampled_from(["1", "x-y"])), max_size=2
).map(lambda pairs: TraceState(list(dict(pairs).items())))
span_contexts = st.builds(
    SpanContext,
    trace_id=st.integers(1, 2**128 - 1),
    span_id=st.integers(1, 2**64 - 1),
    is_remote=st.booleans(),
    trace_flags=st.sampled_from([TraceFlags(0), TraceFlags(1)]),
    trace_state=trace_states,
)
statuses = st.one_of(
    st.none(),
    st.sampled_from([Status(StatusCode.OK), Status(StatusCode.ERROR)]),
    texts.map(lambda text: Status(StatusCode.ERROR, text)),
)
span_plans = st.fixed_dictionaries(
    {
        "name": texts,
        "kind": st.sampled_from(list(SpanKind)),
        "attributes": attributes,
        "parent": st.one_of(st.none(), span_contexts),
        "status": statuses,
        "events": st.lists(st.tuples(texts, attributes, st.integers(0, 2**62)), max_size=3),
        "links": st.lists(st.tuples(span_contexts, attributes), max_size=2),
        "scope": st.integers(0, 2),
    }
)
scopes = st.lists(
    st.tuples(
        texts,
        st.one_of(st.none(), texts),
        st.one_of(st.none(), texts),
        st.one_of(st.none(), attributes),
    ),
    min_size=3,
    max_size=3,
)


def finished_spans(
    plans: list[dict[str, Any]], resource: Resource, scope_specs: list[Any]
) -> tuple[Any, ...]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=resource,
        span_limits=SpanLimits(
            max_span_attributes=4,
            max_events=2,
            max_links=1,
            max_event_attributes=3,
            max_link_attributes=3,
        ),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracers = [
        provider.get_tracer(name, version, schema_url, scope_attributes)
        for name, version, schema_url, scope_attributes in scope_specs
    ]
    for plan in plans:
        parent = plan["parent"]
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        span = tracers[plan["scope"]].start_span(
            plan["name"],
            context=context,
            kind=plan["kind"],
            attributes=plan["attributes"],
            links=[
                Link(link_context, link_attributes)
                for link_context, link_attributes in plan["links"]
            ],
        )
        for name, event_attributes, timestamp in plan["events"]:
            span.add_event(name, event_attributes, timestamp=timestamp)
        if plan["status"] is not None:
            span.set_status(plan["status"])
        span.end()
    provider.shutdown()
    return exporter.get_finished_spans()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(span_plans, min_size=1, max_size=5), attributes, st.one_of(st.none(), texts), scopes
)
def test_any_batch_encodes_to_the_sdk_encoders_message(
    plans, resource_attributes, schema_url, scope_specs
) -> None:
    spans = finished_spans(plans, Resource(resource_attributes, schema_url), scope_specs)
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert ours == sdk_encode_spans(spans)


def test_spans_of_equal_resources_from_two_providers_are_grouped_as_the_sdk_does() -> None:
    plan = {
        "name": "probe",
        "kind": SpanKind.INTERNAL,
        "attributes": {"n": 1},
        "parent": None,
        "status": None,
        "events": [],
        "links": [],
        "scope": 0,
    }
    scope = [("fanout", "1", None, None)] * 3
    first, second = (
        finished_spans([plan, plan], Resource({"service.name": "x"}), scope) for _ in range(2)
    )
    # Equal resources and scopes, distinct objects: one resource group, one scope group.
    mixed = [first[0], second[0], first[1], second[1]]
    ours = ExportTraceServiceRequest.FromString(encode_spans(mixed))
    assert ours == sdk_encode_spans(mixed)
    assert len(ours.resource_spans) == 1 and len(ours.resource_spans[0].scope_spans) == 1


def test_the_http_exporter_sends_these_bytes_and_a_module_without_an_encoder_is_left_alone() -> (
    None
):
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    handle = configure_tracing(
        TracingSettings(exporter="otlp", endpoint="http://127.0.0.1:9"), set_global=False, env={}
    )
    try:
        span = provider_of(handle).get_tracer("test").start_span("probe", attributes={"k": "v"})
        span.end()
        assert isinstance(span, ReadableSpan)
        # The name the exporter imported, where use_for_http_export put ours.
        sent = trace_exporter.encode_spans  # type: ignore[attr-defined]
        assert sent([span]).SerializePartialToString() == encode_spans([span])
    finally:
        handle.shutdown(timeout_ms=100)
    assert use_for_http_export(types.ModuleType("no_encoder")) is False
