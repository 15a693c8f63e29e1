"""What one span costs a traced call, split into whose work it is.

Run by :mod:`bench.micro` in a process of its own, monkey-patched as ``fanout serve`` is,
with the SDK set up as Fanout sets it for 100% sampling (a parent-based always-on
sampler, :func:`tracing.batching.batch_processor`), under one request span:

* ``sdk``: the OpenTelemetry SDK's own work for one INTERNAL span with a task span's four
  attributes: start, made current, one more attribute, end, queued to the batch
  processor, and exported in batches to an exporter that drops them;
* ``encode``: the same, exported through Fanout's OTLP encoder
  (:func:`tracing.otlp_wire.encode_spans`) into bytes nobody sends; ``encode`` less
  ``sdk`` is the encoder's share;
* ``task_span``: the same span made by Fanout's own helper
  (:func:`tracing.spans.task_span` and :func:`tracing.spans.mark_task_outcome`) and
  encoded: less ``encode``, what our code adds to a span.

Each figure is CPU time (``time.process_time``) per span, over reps of ``spans`` spans,
the batch processor flushed at the end of each rep so its export is inside the rep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["measure_span_cost"]

_TASK_ATTRIBUTES = {
    "fanout.async": True,
    "fanout.task.name": "errors",
    "fanout.task.source": "mongo",
    "fanout.pool.wait_ms": 0.12,
}


def measure_span_cost(reps: int, spans: int) -> dict[str, list[float]]:
    """Per-span CPU microseconds of each way above, ``reps`` samples each, interleaved."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    from tracing.batching import batch_processor
    from tracing.otlp_wire import encode_spans
    from tracing.spans import follow_parent_sampling

    class Sink(SpanExporter):
        def __init__(self, encode: bool) -> None:
            self.encode = encode

        def export(self, batch: Sequence[Any]) -> SpanExportResult:
            if self.encode:
                encode_spans(batch)
            return SpanExportResult.SUCCESS

    sinks = {"sdk": Sink(False), "encode": Sink(True), "task_span": Sink(True)}
    providers = {}
    for name, sink in sinks.items():
        provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
        provider.add_span_processor(batch_processor(sink, {}))
        providers[name] = provider
    tracers = {name: provider.get_tracer("bench") for name, provider in providers.items()}
    # task_span uses the global tracer, as the service does.
    trace.set_tracer_provider(providers["task_span"])
    follow_parent_sampling(True)
    ways: dict[str, Callable[[], None]] = {
        "sdk": _sdk_span(tracers["sdk"]),
        "encode": _sdk_span(tracers["encode"]),
        "task_span": _fanout_task_span,
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(reps + 2):  # the first two warm up
        for name, way in ways.items():
            began = time.process_time()
            with tracers[name].start_as_current_span("AppStats/get_app_stats"):
                for _ in range(spans):
                    way()
            providers[name].force_flush()
            if rep >= 2:
                samples[name].append((time.process_time() - began) * 1e6 / spans)
    return samples


def _sdk_span(tracer: Any) -> Callable[[], None]:
    from opentelemetry import trace

    def one() -> None:
        span = tracer.start_span("fanout.task errors", attributes=_TASK_ATTRIBUTES)
        with trace.use_span(span, end_on_exit=False):
            span.set_attribute("fanout.task.status", "OK")
        span.end()

    return one


def _fanout_task_span() -> None:
    from tracing.spans import mark_task_outcome, task_span

    with task_span("errors", "mongo", 0.12) as span:
        mark_task_outcome(span, "OK")
