"""Metrics: the OpenTelemetry SDK's meter provider, exported for Prometheus or over OTLP.

:func:`configure_metrics` installs the global meter provider from
:class:`~tracing.settings.MetricsSettings` and the standard variables
(``OTEL_METRICS_EXPORTER``; ``OTEL_EXPORTER_PROMETHEUS_HOST``/``_PORT``;
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``/``OTEL_EXPORTER_OTLP_ENDPOINT``):

* ``prometheus``: opentelemetry-exporter-prometheus's reader on a registry of
  its own; :attr:`Metrics.registry` and :attr:`Metrics.scrape_at` say what to
  serve where (``service.operations.metrics_endpoint`` serves it, off the event loop);
* ``otlp``: a periodic reader pushing OTLP over HTTP;
* ``none`` (the default): no provider; every instrument is the API's no-op.

Instruments are created against the global API (``metrics.get_meter``) when
their modules load; the API's proxy hands them to the provider once installed.
Histograms measured in seconds get bucket bounds between 1 ms and 10 s.

This module also publishes every :class:`~tracing.pools.PoolMeter` alive as
``fanout.pool.*`` gauges (size, in use, wait p99, recommended size).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from tracing.settings import METRIC_EXPORTERS, MetricsSettings

__all__ = [
    "Metrics",
    "configure_metrics",
    "exporter_name",
    "scrape_address",
    "seconds_views",
    "SECONDS_BUCKETS",
]

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DEFAULT_HOST, _DEFAULT_PORT = "127.0.0.1", 9464


class Metrics:
    """The handle on a configured meter provider; :meth:`shutdown` at exit."""

    def __init__(
        self,
        provider: MeterProvider | None,
        exporter: str,
        registry: Any = None,
        scrape_at: tuple[str, int] | None = None,
    ) -> None:
        self.provider = provider
        self.exporter = exporter
        #: The Prometheus registry to serve, and where (host, port; 0 any); None otherwise.
        self.registry = registry
        self.scrape_at = scrape_at

    def shutdown(self, timeout_ms: int = 2000) -> None:
        """Flush and stop the readers; idempotent."""
        provider, self.provider = self.provider, None
        if provider is not None:
            provider.shutdown(timeout_millis=timeout_ms)


def configure_metrics(
    settings: MetricsSettings,
    *,
    env: Mapping[str, str] | None = None,
    resource: Resource | None = None,
) -> Metrics:
    """Install the global meter provider ``settings`` describes, if any, with ``resource``
    (the traces' own, so both name the same ``service.name``).

    Raises :class:`ValueError` naming the variable for an unknown exporter or a
    Prometheus port that is not a number.
    """
    environment = os.environ if env is None else env
    name = exporter_name(settings, environment)
    if name == "none":
        return Metrics(None, name)
    registry, scrape_at = None, None
    if name == "prometheus":
        reader, registry, scrape_at = _prometheus_reader(settings, environment)
    else:
        reader = _otlp_reader(settings)
    provider = MeterProvider(
        metric_readers=[reader],
        views=seconds_views(),
        resource=resource if resource is not None else Resource.create({}),
    )
    metrics.set_meter_provider(provider)
    if metrics.get_meter_provider() is not provider:
        log.warning("a meter provider was already installed; metrics go to that one")
    return Metrics(provider, name, registry, scrape_at)


def seconds_views() -> list[View]:
    """The views every provider of ours takes: durations in :data:`SECONDS_BUCKETS`."""
    return [
        View(
            instrument_name="*duration*",
            aggregation=ExplicitBucketHistogramAggregation(SECONDS_BUCKETS),
        )
    ]


def exporter_name(settings: MetricsSettings, env: Mapping[str, str] | None = None) -> str:
    """The metric exporter ``settings`` and ``OTEL_METRICS_EXPORTER`` choose; ValueError if
    unknown."""
    environment = os.environ if env is None else env
    name = (
        settings.exporter or environment.get("OTEL_METRICS_EXPORTER", "").strip().lower() or "none"
    )
    if name not in METRIC_EXPORTERS:
        raise ValueError(
            f"OTEL_METRICS_EXPORTER: unsupported exporter {name!r}; "
            f"expected one of {', '.join(METRIC_EXPORTERS)}"
        )
    return name


def scrape_address(
    settings: MetricsSettings, env: Mapping[str, str] | None = None
) -> tuple[str, int] | None:
    """Where Prometheus scrapes (host, port; 0 any free port), or None without that exporter."""
    environment = os.environ if env is None else env
    if exporter_name(settings, environment) != "prometheus":
        return None
    host = (
        settings.host
        or environment.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip()
        or _DEFAULT_HOST
    )
    port = settings.port
    if port < 0:
        raw = environment.get("OTEL_EXPORTER_PROMETHEUS_PORT", "").strip()
        try:
            port = int(raw) if raw else _DEFAULT_PORT
        except ValueError:
            raise ValueError(
                f"OTEL_EXPORTER_PROMETHEUS_PORT: must be a port number, got {raw!r}"
            ) from None
    return host, port


def _prometheus_reader(
    settings: MetricsSettings, env: Mapping[str, str]
) -> tuple[MetricReader, Any, tuple[str, int]]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    scrape_at = scrape_address(settings, env)
    assert scrape_at is not None
    # A registry of its own: a second provider in one process (tests) does not collide.
    registry = CollectorRegistry(auto_describe=True)
    return PrometheusMetricReader(registry=registry), registry, scrape_at


def _otlp_reader(settings: MetricsSettings) -> MetricReader:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(
        OTLPMetricExporter(), export_interval_millis=settings.export_interval_ms
    )
