"""Tracing set-up: one ``TracerProvider`` per process, from settings and the standard ``OTEL_*``
variables.

Precedence for every choice: the ``[tracing]`` settings, then the standard
OpenTelemetry environment variable, then the SDK default.

* service name: ``tracing.service_name``, ``OTEL_SERVICE_NAME``, ``"fanout"``;
* sampler: ``tracing.sample_ratio >= 0`` gives ``ParentBased(TraceIdRatioBased(ratio))``;
  otherwise ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``; otherwise parent-based always-on;
* exporter: ``tracing.exporter``, ``OTEL_TRACES_EXPORTER``, ``"otlp"`` (``otlp``, ``console``,
  ``none``);
* OTLP protocol: ``tracing.otlp_protocol``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,
  ``OTEL_EXPORTER_OTLP_PROTOCOL``, ``"http/protobuf"``;
* OTLP endpoint: ``tracing.endpoint`` (a collector base URL, like ``OTEL_EXPORTER_OTLP_ENDPOINT``),
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is), ``OTEL_EXPORTER_OTLP_ENDPOINT``, SDK default.

The remaining exporter options (headers, timeout, compression, certificates) and
``OTEL_RESOURCE_ATTRIBUTES`` are read by the SDK itself from the process environment.

Spans leave through a ``BatchSpanProcessor`` (:mod:`tracing.batching`: sized by
``OTEL_BSP_*``, else Fanout's defaults), whose
worker is a greenlet once gevent has patched ``threading``; the SDK suppresses
instrumentation around each export, so the exporter's own HTTP calls never become spans.

With ``tracing.tail_capture`` (the default) the provider installed globally is
:class:`tracing.capture.CapturingProvider`: every call's spans are recorded as plain data,
and a call worth keeping reaches the same exporting processors as the SDK's spans would.

OpenTelemetry lets a process install its global provider once; a second
``configure_tracing(..., set_global=True)`` raises :class:`TracingAlreadyConfigured`
rather than being silently ignored. ``set_global=False`` builds a standalone
provider: not installed, and without instrumentation (which is process-wide).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import gevent
import gevent.monkey
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from pymongo import monitoring

from tracing.batching import batch_processor
from tracing.capture import Capture, CapturingProvider
from tracing.capture_rules import KeepRules
from tracing.clients import (
    MongoConnectionEvents,
    own_mongo_spans,
    pymongo_request_hook,
    requests_request_hook,
)
from tracing.conventions import prefer_stable_conventions
from tracing.exceptions import ExceptionEventsWithoutSource
from tracing.export_outages import ReportedExporter
from tracing.exporters import build_exporters
from tracing.http_spans import own_http_spans
from tracing.settings import TracingSettings
from tracing.spans import follow_parent_sampling

if TYPE_CHECKING:
    from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "Tracing",
    "TracingAlreadyConfigured",
    "build_resource",
    "configure_tracing",
]

DEFAULT_SERVICE_NAME = "fanout"
_RATIO_SAMPLERS: dict[str, Callable[[float], Sampler]] = {
    "traceidratio": lambda ratio: TraceIdRatioBased(ratio),
    "parentbased_traceidratio": lambda ratio: ParentBased(TraceIdRatioBased(ratio)),
}
_FIXED_SAMPLERS: dict[str, Sampler] = {
    "always_on": ALWAYS_ON,
    "always_off": ALWAYS_OFF,
    "parentbased_always_on": ParentBased(ALWAYS_ON),
    "parentbased_always_off": ParentBased(ALWAYS_OFF),
}

_mongo_events_registered = False

_log = logging.getLogger(__name__)


class TracingAlreadyConfigured(RuntimeError):
    """Raised by :func:`configure_tracing` when this process already has a global tracer
    provider."""


class Tracing:
    """The handle on a configured provider: flush and shut it down at exit.

    ``provider`` is ``None`` when tracing is disabled; every method is then a no-op.
    """

    def __init__(
        self,
        provider: TracerProvider | None,
        exporters: Sequence[SpanExporter] = (),
        instrumentors: Sequence[BaseInstrumentor] = (),
        own_mongo_spans: bool = False,
        installed: trace.TracerProvider | None = None,
        own_http_spans: bool = False,
    ) -> None:
        """``own_mongo_spans``, ``own_http_spans``: this handle switched our own MongoDB or
        HTTP spans on (and its shutdown switches them off). ``installed``: the global
        provider it installed, when not ``provider`` itself (tail capture's)."""
        self.provider = provider
        self.installed = installed or provider
        self.exporters: tuple[SpanExporter, ...] = tuple(exporters)
        self._instrumentors = tuple(instrumentors)
        self._own_mongo_spans = own_mongo_spans
        self._own_http_spans = own_http_spans
        self._shut_down = False

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        """Export every finished span now; ``False`` if that did not complete in ``timeout_ms``.

        The batch processor ignores the timeout once an export has started; each
        export request is bounded by the exporter's own timeout (10 s by default).
        """
        if self.provider is None or self._shut_down:
            return True
        return self.provider.force_flush(timeout_ms)

    def shutdown(self, timeout_ms: int | None = None) -> bool:
        """Undo the instrumentation this handle did, flush pending spans, stop exporting.
        Idempotent.

        With ``timeout_ms`` (``tracing.flush_timeout_ms`` at shutdown) this returns
        within about that long even when the collector is down or hangs: an export
        still running then is told to stop retrying and left behind, and its spans
        are lost. Without it, each export may take the exporter's own timeout.
        Returns False if the spans were not all flushed in time.
        """
        if self.provider is None or self._shut_down:
            return True
        self._shut_down = True
        for instrumentor in self._instrumentors:
            instrumentor.uninstrument()
        if self._own_mongo_spans:
            own_mongo_spans(False)
        if self._own_http_spans:
            own_http_spans(False)
        if timeout_ms is None:
            self.provider.shutdown()
            return True
        return self._shutdown_within(timeout_ms / 1000.0)

    def _shutdown_within(self, timeout_s: float) -> bool:
        assert self.provider is not None
        # The budget is a timer greenlet: both steps wait on it, and nothing reads the time.
        budget = gevent.spawn_later(timeout_s, lambda: None)
        try:
            return self._flush_and_close(budget, timeout_s)
        finally:
            budget.kill(block=False)

    def _flush_and_close(self, budget: gevent.Greenlet, timeout_s: float) -> bool:
        assert self.provider is not None
        # The SDK's flush ignores its timeout once an export runs, so bound it from outside.
        flush = gevent.spawn(self.provider.force_flush)
        gevent.wait([flush, budget], count=1)
        flushed = flush.ready() and flush.successful() and bool(flush.value)
        if not flush.ready():
            _log.warning(
                "tracing: spans not exported within %.0f ms; dropping the rest", timeout_s * 1000.0
            )
            for exporter in self.exporters:
                exporter.shutdown()  # ends the exporter's retry wait; further batches are dropped
        close = gevent.spawn(self.provider.shutdown)
        gevent.wait([close, budget], count=1)
        if not close.ready():
            close.join(timeout=0.05)  # a last moment, should the budget have gone on the flush
        return flushed and close.ready()

    def __repr__(self) -> str:
        names = ", ".join(type(exporter).__name__ for exporter in self.exporters) or "no exporter"
        state = "disabled" if self.provider is None else ("shut down" if self._shut_down else names)
        return f"<Tracing {state}>"


def configure_tracing(
    settings: TracingSettings,
    *,
    extra_processors: Sequence[SpanProcessor] = (),
    set_global: bool = True,
    env: Mapping[str, str] | None = None,
) -> Tracing:
    """Build the tracer provider described by ``settings`` and, by default, install it globally.

    ``env`` stands in for ``os.environ`` when choosing the service name, sampler,
    exporter, protocol, endpoint and batch sizes (``OTEL_BSP_*``). With ``set_global`` the pymongo
    and requests
    instrumentations are switched on (unless already on) and bound to the provider;
    pymongo only traces clients created after this call.

    Raises :class:`ValueError` naming the variable for an unknown exporter or protocol
    named in the environment, and :class:`TracingAlreadyConfigured` when
    ``set_global`` is true and a global provider is already installed.
    """
    if not settings.enabled:
        return Tracing(None)
    environment = os.environ if env is None else env
    if set_global and not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        raise TracingAlreadyConfigured(
            "a global tracer provider is already installed in this process; "
            "use set_global=False for a standalone provider"
        )
    exporters = build_exporters(settings, environment)
    provider = TracerProvider(
        resource=build_resource(settings, environment),
        sampler=_build_sampler(settings, environment),
    )
    provider.add_span_processor(ExceptionEventsWithoutSource())  # first: before any span records
    # One chain of the processors that export: the provider's spans and the calls tail
    # capture keeps go through the same ones.
    exporting = SynchronousMultiSpanProcessor()  # type: ignore[no-untyped-call]  # the SDK's
    for exporter in exporters:
        reported = ReportedExporter(exporter, f"the {type(exporter).__name__}")
        exporting.add_span_processor(batch_processor(reported, environment))
    for processor in extra_processors:
        exporting.add_span_processor(processor)
    provider.add_span_processor(exporting)
    if not set_global:
        return Tracing(provider, exporters)
    installed: trace.TracerProvider = provider
    if settings.tail_capture:
        rules = KeepRules(
            settings.tail_slow_ms, settings.tail_slow_quantile, settings.tail_max_per_s
        )
        installed = CapturingProvider(
            Capture(provider.sampler, exporting, provider.resource, rules, provider.id_generator)
        )
    trace.set_tracer_provider(installed)
    if trace.get_tracer_provider() is not installed:
        # Another installer won between our check and our set; the API ignored ours.
        provider.shutdown()
        raise TracingAlreadyConfigured("another tracer provider was installed concurrently")
    # Every ParentBased sampler built here keeps the default: an unsampled parent's children are
    # dropped. Under tail capture every span is recorded: a call is judged when it ends.
    follow_parent_sampling(
        not settings.tail_capture
        and (isinstance(provider.sampler, ParentBased) or provider.sampler is ALWAYS_OFF)
    )
    own, own_http = settings.mongo_spans == "own", settings.http_spans == "own"
    instrumentors = _instrument(installed, own_mongo=own, own_http=own_http)
    return Tracing(
        provider,
        exporters,
        instrumentors,
        own_mongo_spans=own,
        installed=installed,
        own_http_spans=own_http,
    )


def build_resource(settings: TracingSettings, env: Mapping[str, str] | None = None) -> Resource:
    """The process's resource: ``service.name`` from ``tracing.service_name``,
    ``OTEL_SERVICE_NAME`` or ``fanout``; the metrics carry the same one."""
    environment = os.environ if env is None else env
    name = (
        settings.service_name
        or environment.get("OTEL_SERVICE_NAME", "").strip()
        or DEFAULT_SERVICE_NAME
    )
    return Resource.create({SERVICE_NAME: name})


def _build_sampler(settings: TracingSettings, env: Mapping[str, str]) -> Sampler:
    if settings.sample_ratio >= 0:
        return ParentBased(TraceIdRatioBased(settings.sample_ratio))
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if not name:
        return ParentBased(ALWAYS_ON)
    if name in _FIXED_SAMPLERS:
        return _FIXED_SAMPLERS[name]
    if name in _RATIO_SAMPLERS:
        return _RATIO_SAMPLERS[name](_sampler_ratio(env.get("OTEL_TRACES_SAMPLER_ARG", "")))
    # The specification asks for a warning and the default, not a failure, here.
    _log.warning("OTEL_TRACES_SAMPLER=%r is not supported; using parentbased_always_on", name)
    return ParentBased(ALWAYS_ON)


def _sampler_ratio(raw: str) -> float:
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if 0.0 <= ratio <= 1.0:
        return ratio
    if raw.strip():
        _log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]; using 1.0", raw)
    return 1.0


def _instrument(
    provider: trace.TracerProvider, own_mongo: bool, own_http: bool
) -> tuple[BaseInstrumentor, ...]:
    """Switch on the official instrumentations not already on, the pymongo one only
    unless ``own_mongo`` (our own MongoDB spans instead, :mod:`tracing.clients`), the
    requests one only unless ``own_http`` (:mod:`tracing.http_spans`); return those this
    call switched on.

    They emit the current (stable) HTTP and database conventions (``server.address``,
    ``db.system.name``, ...) unless ``OTEL_SEMCONV_STABILITY_OPT_IN`` says otherwise,
    and their spans get readable names and ``peer.service`` (:mod:`tracing.clients`).
    """
    # Imported here: with our own client spans (the default) no official instrumentation
    # runs, and importing them costs every process's start tens of milliseconds.
    from opentelemetry.instrumentation.pymongo import PymongoInstrumentor
    from opentelemetry.instrumentation.requests import RequestsInstrumentor

    global _mongo_events_registered
    prefer_stable_conventions()
    if not _mongo_events_registered:
        # Global, like the instrumentation's own listener: every client made after this sees it.
        monitoring.register(MongoConnectionEvents())
        _mongo_events_registered = True
    switched_on = []
    official: list[tuple[BaseInstrumentor, dict[str, Any]]] = []
    if own_http:
        own_http_spans(True)
    else:
        official.append((RequestsInstrumentor(), {"request_hook": requests_request_hook}))
    if own_mongo:
        own_mongo_spans(True)
    else:
        official.append((PymongoInstrumentor(), {"request_hook": pymongo_request_hook}))
    for instrumentor, hooks in official:
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider, **hooks)
            switched_on.append(instrumentor)
    return tuple(switched_on)
