"""Pytest plugin: one global tracer provider for the whole session, and a ``spans`` fixture.

OpenTelemetry lets a process install its global provider once, so the session
installs it first thing (autouse) through :func:`tracing.setup.configure_tracing`:
no exporter, a synchronous in-memory processor, pymongo and requests instrumented.
Tests that need their own provider build a standalone one (``set_global=False``).

    def test_something(spans):
        ...
        names = [span.name for span in spans.get_finished_spans()]
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracing.settings import TracingSettings
from tracing.setup import Tracing, configure_tracing

__all__ = ["session_tracing", "span_exporter", "spans", "provider_of"]

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="session", autouse=True)
def session_tracing() -> Iterator[Tracing]:
    """The process-wide provider every test's spans go to."""
    tracing = configure_tracing(
        # A fixed slow threshold: no call of the session is kept for being slow by chance.
        TracingSettings(exporter="none", service_name="fanout-tests", tail_slow_ms=60_000),
        extra_processors=[SimpleSpanProcessor(_exporter)],
        env={},
    )
    yield tracing
    tracing.shutdown()


@pytest.fixture(scope="session")
def span_exporter(session_tracing: Tracing) -> InMemorySpanExporter:
    """The session's in-memory exporter, without clearing it."""
    return _exporter


@pytest.fixture
def spans(span_exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    """The in-memory exporter, emptied before the test: ``spans.get_finished_spans()``."""
    span_exporter.clear()
    return span_exporter


def provider_of(handle: Tracing) -> TracerProvider:
    """The provider of a configured (enabled) ``handle``."""
    assert handle.provider is not None, "tracing is disabled"
    return handle.provider
