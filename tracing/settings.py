"""The ``[tracing]`` settings section.

Empty strings and a negative ratio defer to the standard ``OTEL_*`` variables,
then to the SDK's defaults. Each key is declared once, in its field's metadata
(type, bounds, default, help), as ``service/settings/declarations.py`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "TracingSettings",
    "MetricsSettings",
    "EXPORTERS",
    "OTLP_PROTOCOLS",
    "METRIC_EXPORTERS",
    "MONGO_SPANS",
    "HTTP_SPANS",
]

#: Span exporters, by their ``OTEL_TRACES_EXPORTER`` names.
EXPORTERS = ("otlp", "zipkin", "console", "none")
#: Who makes the MongoDB command spans (``tracing.mongo_spans``), and the HTTP ones
#: (``tracing.http_spans``).
MONGO_SPANS = ("own", "official")
HTTP_SPANS = ("own", "official")
#: OTLP protocols, by their ``OTEL_EXPORTER_OTLP_PROTOCOL`` names.
OTLP_PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class TracingSettings:
    """Tracing. Empty strings defer to the standard ``OTEL_*`` variables, then SDK defaults."""

    enabled: bool = field(default=True, metadata={"help": "`false`: no provider, spans are no-ops"})
    exporter: str = field(
        default="",
        metadata={
            "help": "`otlp`, `zipkin`, `console` or `none`; empty: `OTEL_TRACES_EXPORTER`, "
            "else `otlp`",
            "choices": ("", *EXPORTERS),
        },
    )
    otlp_protocol: str = field(
        default="",
        metadata={
            "help": "`http/protobuf` or `grpc`; empty: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, then "
            "`OTEL_EXPORTER_OTLP_PROTOCOL`, else `http/protobuf`",
            "choices": ("", *OTLP_PROTOCOLS),
        },
    )
    endpoint: str = field(
        default="",
        metadata={
            "help": "collector base URL, e.g. `http://collector:4318` (`/v1/traces` is appended "
            "for HTTP) or `http://collector:4317` for gRPC; empty: "
            "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is), then "
            "`OTEL_EXPORTER_OTLP_ENDPOINT`, else `localhost:4318` / `:4317`"
        },
    )
    zipkin_endpoint: str = field(
        default="",
        metadata={
            "help": "where `zipkin` posts spans (Zipkin v2 JSON); empty: "
            "`OTEL_EXPORTER_ZIPKIN_ENDPOINT`, else `http://localhost:9411/api/v2/spans`"
        },
    )
    service_name: str = field(
        default="",
        metadata={
            "help": "the `service.name` resource attribute; empty: `OTEL_SERVICE_NAME`, "
            "else `fanout`"
        },
    )
    sample_ratio: float = field(
        default=-1.0,
        metadata={
            "help": "`0..1`: parent-based trace-id-ratio sampling; below 0: `OTEL_TRACES_SAMPLER` "
            "and `OTEL_TRACES_SAMPLER_ARG`, else parent-based always-on",
            "max": 1.0,
        },
    )
    mongo_spans: str = field(
        default="own",
        metadata={
            "help": "who makes the MongoDB command spans: `own`, Fanout's record of each "
            "command it sends, written to the same conventions; `official`, the pymongo "
            "instrumentation, whose command listener costs every command, sampled or not "
            "(see [Tracing](../how-to/tracing.md))",
            "choices": MONGO_SPANS,
        },
    )
    http_spans: str = field(
        default="own",
        metadata={
            "help": "who makes the HTTP client spans and `http.client.request.duration`: "
            "`own`, Fanout's record of each request a lookup sends, written as the official "
            "requests instrumentation writes them; `official`, that instrumentation, which "
            "wraps every request of the process (see [Tracing](../how-to/tracing.md))",
            "choices": HTTP_SPANS,
        },
    )
    tail_capture: bool = field(
        default=True,
        metadata={
            "help": "record every call's spans as plain data and export the calls that "
            "matter whatever `sample_ratio` says: a panel not OK, a call shed, refused or "
            "cut, or slower than the slow threshold; `false`: the SDK's spans, head "
            "sampling alone",
        },
    )
    tail_slow_ms: int = field(
        default=0,
        metadata={
            "help": "tail capture keeps a call that took longer than this; `0`: longer than "
            "its method's recent `tail_slow_quantile`",
            "min": 0,
        },
    )
    tail_slow_quantile: float = field(
        default=0.99,
        metadata={
            "help": "with `tail_slow_ms` 0: the quantile of a method's last 512 durations "
            "above which a call is slow (none until 100 calls)",
            "min": 0.5,
            "max": 1.0,
        },
    )
    tail_max_per_s: int = field(
        default=100,
        metadata={
            "help": "calls kept by tail capture (not by the head sampler) a second at most, in "
            "a burst too; the excess is dropped and "
            'counted (`fanout_traces_dropped_total{reason="ceiling"}`); `0`: no ceiling',
            "min": 0,
        },
    )
    flush_timeout_ms: int = field(
        default=2_000,
        metadata={
            "help": "at shutdown, how long to wait for pending spans to export; the rest are "
            "dropped with a warning",
            "min": 0,
        },
    )


#: Metric exporters, by their ``OTEL_METRICS_EXPORTER`` names.
METRIC_EXPORTERS = ("prometheus", "otlp", "none")


@dataclass(frozen=True)
class MetricsSettings:
    """The ``[metrics]`` section. Empty strings and -1 defer to the ``OTEL_*`` variables.

    ``exporter`` (``OTEL_METRICS_EXPORTER``) is ``none`` unless set: a scrape
    port is opened only when asked for. With ``server.workers`` > 1 the master
    serves the scrape port for the whole group.
    """

    exporter: str = field(
        default="",
        metadata={
            "help": "`prometheus`, `otlp` or `none`; empty: `OTEL_METRICS_EXPORTER`, else `none` "
            "(see [Metrics](../reference/metrics.md))",
            "choices": ("", *METRIC_EXPORTERS),
        },
    )
    host: str = field(
        default="",
        metadata={
            "help": "where Prometheus scrapes; empty: `OTEL_EXPORTER_PROMETHEUS_HOST`, "
            "else `127.0.0.1`"
        },
    )
    port: int = field(
        default=-1,
        metadata={
            "help": "the scrape port (`0`: any free one, logged); `-1`: "
            "`OTEL_EXPORTER_PROMETHEUS_PORT`, else `9464`",
            "min": -1,
            "max": 65535,
        },
    )
    export_interval_ms: int = field(
        default=10_000, metadata={"help": "`otlp`: how often metrics are pushed", "min": 1}
    )
