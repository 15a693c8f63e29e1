"""configure_tracing: exporter, protocol, sampler and service-name selection, the global provider,
and the batch processor's sizes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.instrumentation.pymongo import PymongoInstrumentor
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import tracing.http_spans
from tests.support.tracing import provider_of
from tracing.batching import batch_processor
from tracing.settings import TracingSettings
from tracing.setup import DEFAULT_SERVICE_NAME, Tracing, TracingAlreadyConfigured, configure_tracing

SAMPLED_REMOTE_PARENT = SpanContext(
    trace_id=0x5B8AA5A2D2C872E8321CF37308D69DF2,
    span_id=0x051581BF3CB55C13,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
)


@pytest.fixture
def build() -> Iterator[Any]:
    """Build standalone providers and shut every one down after the test."""
    handles: list[Tracing] = []

    def _build(env: Mapping[str, str] | None = None, **settings: Any) -> Tracing:
        handle = configure_tracing(TracingSettings(**settings), set_global=False, env=env or {})
        handles.append(handle)
        return handle

    yield _build
    for handle in handles:
        handle.shutdown()


def exporter_types(handle: Tracing) -> list[type]:
    return [type(exporter) for exporter in handle.exporters]


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"exporter": "console"}, [ConsoleSpanExporter]),
        ({"exporter": "none"}, []),
        ({"exporter": "otlp"}, [HttpExporter]),
        ({"exporter": "otlp", "otlp_protocol": "http/protobuf"}, [HttpExporter]),
        ({"exporter": "otlp", "otlp_protocol": "grpc"}, [GrpcExporter]),
        ({}, [HttpExporter]),
    ],
)
def test_exporter_is_chosen_from_settings(build, settings, expected) -> None:
    assert exporter_types(build(**settings)) == expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter]),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, [HttpExporter, ConsoleSpanExporter]),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcExporter]),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            [GrpcExporter],
        ),
    ],
)
def test_exporter_and_protocol_are_chosen_from_otel_env(build, env, expected) -> None:
    assert exporter_types(build(env)) == expected


def test_settings_win_over_otel_env(build) -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert exporter_types(build(env, exporter="otlp", otlp_protocol="http/protobuf")) == [
        HttpExporter
    ]
    assert exporter_types(build(env, exporter="none")) == []


def test_process_environment_is_used_when_no_mapping_is_given(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-process-env")
    handle = configure_tracing(TracingSettings(), set_global=False)
    try:
        assert exporter_types(handle) == [ConsoleSpanExporter]
        assert provider_of(handle).resource.attributes["service.name"] == "from-process-env"
    finally:
        handle.shutdown()


def test_zipkin_exporter_is_the_official_one_with_remote_endpoints(build, monkeypatch) -> None:
    from opentelemetry.exporter.zipkin.json import ZipkinExporter

    monkeypatch.setenv("OTEL_EXPORTER_ZIPKIN_ENDPOINT", "http://zipkin.example:9411/api/v2/spans")
    (from_env,) = build({"OTEL_TRACES_EXPORTER": "zipkin"}).exporters
    assert isinstance(from_env, ZipkinExporter)
    assert from_env.endpoint == "http://zipkin.example:9411/api/v2/spans"
    assert type(from_env.encoder).__name__ == "RemoteEndpointEncoder"
    (from_settings,) = build(
        exporter="zipkin", zipkin_endpoint="http://127.0.0.1:1/api/v2/spans"
    ).exporters
    assert from_settings.endpoint == "http://127.0.0.1:1/api/v2/spans"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ],
)
def test_unsupported_otel_env_values_fail_at_start_up(build, env, message) -> None:
    with pytest.raises(ValueError, match=message):
        build(env)


@pytest.mark.parametrize(
    "settings, env, expected",
    [
        ({"service_name": "from-settings"}, {"OTEL_SERVICE_NAME": "from-env"}, "from-settings"),
        ({}, {"OTEL_SERVICE_NAME": "from-env"}, "from-env"),
        ({}, {}, DEFAULT_SERVICE_NAME),
    ],
)
def test_service_name_precedence(build, settings, env, expected) -> None:
    handle = build(env, exporter="none", **settings)
    assert provider_of(handle).resource.attributes["service.name"] == expected


def recorded(handle: Tracing, parent: SpanContext | None = None) -> bool:
    """Whether the provider records a span started as a root, or under ``parent``."""
    context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
    span = provider_of(handle).get_tracer("test").start_span("probe", context=context)
    recording = span.is_recording()
    span.end()
    return recording


def test_sample_ratio_setting_is_parent_based(build) -> None:
    handle = build({"OTEL_TRACES_SAMPLER": "always_on"}, exporter="none", sample_ratio=0.0)
    assert "TraceIdRatioBased{0.0}" in provider_of(handle).sampler.get_description()
    assert not recorded(handle)
    assert recorded(handle, SAMPLED_REMOTE_PARENT)


@pytest.mark.parametrize(
    "env, root_recorded, under_sampled_parent",
    [
        ({}, True, True),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, False, False),
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, False, True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, False, False),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            False,
            True,
        ),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "lots"}, True, True),
        ({"OTEL_TRACES_SAMPLER": "no_such_sampler"}, True, True),
    ],
)
def test_sampler_from_otel_env(build, env, root_recorded, under_sampled_parent) -> None:
    handle = build(env, exporter="none")
    assert recorded(handle) is root_recorded
    assert recorded(handle, SAMPLED_REMOTE_PARENT) is under_sampled_parent


def test_ratio_from_otel_env_reaches_the_sampler(build) -> None:
    env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert (
        "TraceIdRatioBased{0.25}" in build(env, exporter="none").provider.sampler.get_description()
    )


def test_extra_processors_receive_spans_and_shutdown_stops_them(build) -> None:
    memory = InMemorySpanExporter()
    handle = configure_tracing(
        TracingSettings(exporter="none"),
        set_global=False,
        env={},
        extra_processors=[SimpleSpanProcessor(memory)],
    )
    provider_of(handle).get_tracer("test").start_span("before").end()
    assert handle.force_flush(1000)
    handle.shutdown()
    handle.shutdown()
    provider_of(handle).get_tracer("test").start_span("after").end()
    assert [span.name for span in memory.get_finished_spans()] == ["before"]


def test_disabled_installs_nothing_and_is_inert(session_tracing) -> None:
    handle = configure_tracing(TracingSettings(enabled=False, exporter="console"), env={})
    assert handle.provider is None and not handle.enabled and handle.exporters == ()
    assert trace.get_tracer_provider() is session_tracing.installed
    assert handle.force_flush(10)
    handle.shutdown()
    assert tracing.http_spans._own_http_spans  # the session's own spans stay on


def test_session_provider_is_global_and_makes_its_own_mongodb_and_http_spans(
    session_tracing,
) -> None:
    """``tracing.mongo_spans`` and ``tracing.http_spans`` are ``"own"`` by default: the
    pymongo and requests instrumentations stay off (the first's command listener costs
    every command, the second wraps every request), and ours are on."""
    import tracing.clients

    assert trace.get_tracer_provider() is session_tracing.installed
    assert not PymongoInstrumentor().is_instrumented_by_opentelemetry
    assert not RequestsInstrumentor().is_instrumented_by_opentelemetry
    assert tracing.clients._own_mongo_spans and tracing.http_spans._own_http_spans


def test_a_second_global_provider_is_refused(session_tracing) -> None:
    with pytest.raises(TracingAlreadyConfigured):
        configure_tracing(TracingSettings(exporter="none"), env={})
    assert trace.get_tracer_provider() is session_tracing.installed


def test_standalone_provider_does_not_touch_instrumentation(build, session_tracing) -> None:
    handle = build(exporter="none")
    handle.shutdown()
    assert tracing.http_spans._own_http_spans
    assert trace.get_tracer_provider() is session_tracing.installed


def batch_sizes(processor: BatchSpanProcessor) -> tuple[int, int, float]:
    inner = processor._batch_processor  # the SDK keeps the sizes here
    return inner._max_queue_size, inner._max_export_batch_size, inner._schedule_delay_millis


def test_batch_processor_sizes_come_from_otel_bsp_else_fanout_defaults() -> None:
    env = {
        "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "junk",
    }
    defaults, configured = (
        batch_processor(InMemorySpanExporter(), {}),
        batch_processor(InMemorySpanExporter(), env),
    )
    try:
        assert batch_sizes(defaults) == (8192, 512, 5000)
        # A batch larger than the queue is cut to it; junk falls back to the default.
        assert batch_sizes(configured) == (100, 100, 5000)
    finally:
        defaults.shutdown()
        configured.shutdown()
