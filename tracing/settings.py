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

__all__ = ["TracingSettings", "EXPORTERS", "OTLP_PROTOCOLS"]

#: Span exporters, by their ``OTEL_TRACES_EXPORTER`` names.
EXPORTERS = ("otlp", "console", "none")
#: OTLP protocols, by their ``OTEL_EXPORTER_OTLP_PROTOCOL`` names.
OTLP_PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class TracingSettings:
    """Tracing. Empty strings defer to the standard ``OTEL_*`` variables, then SDK defaults."""

    enabled: bool = True
    exporter: str = ""                 # otlp | console | none  (OTEL_TRACES_EXPORTER)
    otlp_protocol: str = ""            # grpc | http/protobuf   (OTEL_EXPORTER_OTLP_PROTOCOL)
    endpoint: str = ""                 # OTEL_EXPORTER_OTLP_ENDPOINT
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
