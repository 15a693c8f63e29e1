"""Span exporters chosen by settings or the standard ``OTEL_*`` variables.

``otlp`` (over HTTP, encoded by :mod:`tracing.otlp_wire`, or gRPC), ``zipkin``
(:mod:`tracing.zipkin`, the optional ``zipkin`` extra), ``console``, or ``none``.
Settings win over the environment; the environment over SDK defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

import gevent.monkey
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

from tracing.otlp_wire import use_for_http_export
from tracing.settings import EXPORTERS, OTLP_PROTOCOLS, TracingSettings
from tracing.zipkin import build_zipkin_exporter

__all__ = ["build_exporters", "prepare_grpc_for_gevent"]

_HTTP_TRACES_PATH = "/v1/traces"
_grpc_gevent_ready = False


def build_exporters(settings: TracingSettings, env: Mapping[str, str]) -> list[SpanExporter]:
    """The span exporters ``settings`` (else ``OTEL_TRACES_EXPORTER``) names; none for ``none``.

    Raises :class:`ValueError` naming the variable for an unknown exporter or protocol.
    """
    names = _exporter_names(settings, env)
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        exporters.append(_build_otlp_exporter(settings, env))
    if "zipkin" in names:
        exporters.append(build_zipkin_exporter(settings.zipkin_endpoint))
    if "console" in names:
        exporters.append(ConsoleSpanExporter())
    return exporters


def _exporter_names(settings: TracingSettings, env: Mapping[str, str]) -> set[str]:
    if settings.exporter:
        return {settings.exporter}
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    # The variable is a comma-separated list; a short one is all we ever need to look at.
    names = {name.strip() for name in raw.split(",")[: len(EXPORTERS) + 1] if name.strip()}
    unknown = names - set(EXPORTERS)
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER: unsupported exporter {sorted(unknown)[0]!r}; "
            f"expected one of {', '.join(EXPORTERS)}"
        )
    return names


def _otlp_protocol(settings: TracingSettings, env: Mapping[str, str]) -> str:
    if settings.otlp_protocol:
        return settings.otlp_protocol
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(variable, "").strip().lower()
        if protocol:
            if protocol not in OTLP_PROTOCOLS:
                raise ValueError(
                    f"{variable}: unsupported protocol {protocol!r}; "
                    f"expected one of {', '.join(OTLP_PROTOCOLS)}"
                )
            return protocol
    return "http/protobuf"


def _otlp_endpoint(settings: TracingSettings, env: Mapping[str, str], protocol: str) -> str | None:
    """The endpoint to hand the exporter, or ``None`` for the SDK default."""
    base = settings.endpoint
    if not base:
        signal_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if signal_endpoint:
            return signal_endpoint
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not base or protocol == "grpc" or base.rstrip("/").endswith(_HTTP_TRACES_PATH):
        return base or None
    return base.rstrip("/") + _HTTP_TRACES_PATH


def _build_otlp_exporter(settings: TracingSettings, env: Mapping[str, str]) -> SpanExporter:
    protocol = _otlp_protocol(settings, env)
    endpoint = _otlp_endpoint(settings, env, protocol)
    if protocol == "grpc":
        prepare_grpc_for_gevent()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    use_for_http_export(trace_exporter)
    return trace_exporter.OTLPSpanExporter(endpoint=endpoint)


def prepare_grpc_for_gevent() -> None:
    """Make gRPC's core cooperate with the gevent hub. Idempotent; a no-op without gevent patching.

    Must run before the process creates its first gRPC channel or server; choosing the
    gRPC exporter calls it. Anything else here that uses gRPC calls it first too.
    """
    global _grpc_gevent_ready
    if _grpc_gevent_ready or not gevent.monkey.is_module_patched("socket"):
        return
    from grpc.experimental import gevent as grpc_gevent

    grpc_gevent.init_gevent()
    _grpc_gevent_ready = True
