"""The ``[tracing]`` settings section.

Empty strings and a negative ratio defer to the standard ``OTEL_*`` variables,
then to the SDK's defaults. ``CHOICES`` and ``INT_BOUNDS`` are the per-key rules
the service's loader applies; ``__post_init__`` raises :class:`ValueError`
naming the key for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

__all__ = ["TracingSettings", "MetricsSettings", "EXPORTERS", "OTLP_PROTOCOLS", "METRIC_EXPORTERS"]

#: Span exporters, by their ``OTEL_TRACES_EXPORTER`` names.
EXPORTERS = ("otlp", "zipkin", "console", "none")
#: OTLP protocols, by their ``OTEL_EXPORTER_OTLP_PROTOCOL`` names.
OTLP_PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class TracingSettings:
    """Tracing. Empty strings defer to the standard ``OTEL_*`` variables, then SDK defaults."""

    enabled: bool = True
    exporter: str = ""                 # otlp | zipkin | console | none  (OTEL_TRACES_EXPORTER)
    otlp_protocol: str = ""            # grpc | http/protobuf   (OTEL_EXPORTER_OTLP_PROTOCOL)
    endpoint: str = ""                 # OTEL_EXPORTER_OTLP_ENDPOINT
    zipkin_endpoint: str = ""          # OTEL_EXPORTER_ZIPKIN_ENDPOINT, else localhost:9411
    service_name: str = ""             # OTEL_SERVICE_NAME, else "fanout"
    sample_ratio: float = -1.0         # < 0: OTEL_TRACES_SAMPLER(_ARG), else always on
    flush_timeout_ms: int = 2_000      # at shutdown, how long to wait for spans to export

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType(
        {"exporter": ("", *EXPORTERS), "otlp_protocol": ("", *OTLP_PROTOCOLS)})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"flush_timeout_ms": (0, None)})

    def __post_init__(self) -> None:
        if self.sample_ratio > 1.0:
            raise ValueError("sample_ratio: must be at most 1.0 (negative: use OTEL_TRACES_SAMPLER)")


#: Metric exporters, by their ``OTEL_METRICS_EXPORTER`` names.
METRIC_EXPORTERS = ("prometheus", "otlp", "none")


@dataclass(frozen=True)
class MetricsSettings:
    """The ``[metrics]`` section. Empty strings and -1 defer to the ``OTEL_*`` variables.

    ``exporter`` (``OTEL_METRICS_EXPORTER``) is ``none`` unless set: a scrape
    port is opened only when asked for. ``host`` and ``port``
    (``OTEL_EXPORTER_PROMETHEUS_HOST``/``_PORT``, else 127.0.0.1:9464) are where
    Prometheus scrapes; port 0 picks a free one (logged). With ``server.workers``
    > 1, worker *i* listens on ``port + i``.
    """

    exporter: str = ""                 # prometheus | otlp | none
    host: str = ""
    port: int = -1
    export_interval_ms: int = 10_000   # otlp: how often metrics are pushed

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType(
        {"exporter": ("", *METRIC_EXPORTERS)})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"port": (-1, 65535)})
