"""Tail capture: every call's spans recorded as plain data, and exported only if the call
turns out to matter.

A call that failed a panel, was shed, refused or cut, or ran slower than its peers is what
an operator opens a trace for; head sampling at 1% keeps one in a hundred of those and
still builds the SDK's spans for every call. With ``tracing.tail_capture`` on, the global
tracer provider is a :class:`CapturingProvider`: its spans (:class:`CapturedSpan`) hold
their name, kind, times, attributes, events, links and status in a few plain fields, and
the spans of one call (the root, and every span made under it) share a
:class:`CallRecord`. When the root ends, the record decides (:meth:`Capture.decide`):

- **kept** when a panel was not OK (``fanout.task.status`` ERROR, TIMEOUT, CANCELLED, or
  SKIPPED for ``brownout``), the root ended with status ERROR (a refusal, a failed
  required panel, an invalid request), the call took longer than the slow threshold
  (``tracing.tail_slow_ms``, or the recent ``tail_slow_quantile`` of its method's
  durations), or the head sampler chose it (``sample_ratio``);
- otherwise dropped, with everything it held.

A kept call is handed to the SDK's span processors whole, as the SDK's own
``ReadableSpan`` objects with the recorded ids and times, so its trace is the one a
100%-sampled call shows: same spans, parents, attributes, events and links. A span that
ends after its root (a client span of an abandoned task) follows its call: exported if the
call was kept. Calls kept by their tail are at most ``tracing.tail_max_per_s`` a second
(a token bucket); the excess is dropped and counted, so a storm of failing calls never
makes tracing the overload. Calls the head sampler chose are all kept, as without tail
capture (the batch processor's queue bounds them).

Ids come from the SDK provider's id generator, as its own spans' do. A call's trace id is known
when it starts (the caller's, or a new one) whether it is later kept or not, and is what
the response gives. The trace context sent downstream carries the head sampler's
decision: a service called during a call kept only by its tail sees an unsampled
``traceparent``.

Counted: ``fanout.traces.kept`` by ``reason`` (``panel``, ``shed``, ``cut``, ``error``,
``slow``, ``sampled``; the first that applies, in that order) and ``fanout.traces.dropped``
by ``reason`` (``ordinary``, ``ceiling``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

from lookups.clock import span_time_ns
from tracing.capture_rules import KeepRules, keep_reason

__all__ = ["Capture", "CapturingProvider", "CapturedSpan", "CallRecord"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
#: Spans one call may record; past this, later ones are made but not kept (a call makes ~15).
MAX_SPANS_PER_CALL = 1000
_UNSET = Status(StatusCode.UNSET)


class CallRecord:
    """The spans of one call, from its root's start to its decision."""

    __slots__ = ("capture", "sampled", "root", "spans", "decided", "kept")

    def __init__(self, capture: Capture, sampled: bool) -> None:
        self.capture = capture
        self.sampled = sampled  # the head sampler's decision
        self.root: CapturedSpan | None = None
        self.spans: list[CapturedSpan] = []  # ended, before the decision
        self.decided = False
        self.kept = False

    def ended(self, span: CapturedSpan) -> None:
        if self.decided:
            if self.kept:
                self.capture.export((span,))  # ended after its call: it follows the call
            return
        if len(self.spans) < MAX_SPANS_PER_CALL:
            self.spans.append(span)
        if span is self.root:
            self.decided = True
            self.kept = self.capture.decide(self)
            # No span and its record hold each other now: reference counting frees them.
            spans, self.spans, self.root = self.spans, [], None
            if self.kept:
                self.capture.export(spans)


class CapturedSpan(trace.Span):
    """A span recorded as plain data into its call's :class:`CallRecord`."""

    __slots__ = (
        "record",
        "name",
        "context",
        "parent",
        "kind",
        "attributes",
        "events",
        "links",
        "status",
        "start_time",
        "end_time",
        "scope",
    )

    def __init__(
        self,
        record: CallRecord,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[Link],
        start_time: int,
        scope: InstrumentationScope,
    ) -> None:
        self.record = record
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.events: list[Event] = []
        self.links = tuple(links)
        self.status = _UNSET
        self.start_time = start_time
        self.end_time: int | None = None
        self.scope = scope

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is None:
            self.attributes.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            self.events.append(Event(name, attributes, timestamp or span_time_ns()))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if self.end_time is None and context.is_valid:
            self.links = (*self.links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        # As the SDK has it: OK is final, and UNSET never replaces a status set.
        if self.status.status_code is StatusCode.OK or status.status_code is StatusCode.UNSET:
            return
        self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # Imported here: tracing.exceptions needs the SDK, which this module's users have.
        from tracing.exceptions import exception_attributes

        self.add_event(
            "exception",
            {**exception_attributes(exception, escaped), **(attributes or {})},
            timestamp,
        )

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or span_time_ns()
        for observer in self.record.capture.observers:
            observer.on_end(self)
        self.record.ended(self)

    def readable(self, resource: Resource) -> ReadableSpan:
        """The SDK's span for this record, marked sampled: it is exported."""
        context = self.context
        if not context.trace_flags.sampled:
            context = SpanContext(
                context.trace_id, context.span_id, False, _SAMPLED, context.trace_state
            )
        return ReadableSpan(
            name=self.name,
            context=context,
            parent=self.parent,
            resource=resource,
            attributes=self.attributes,
            events=self.events,
            links=self.links,
            kind=self.kind,
            status=self.status,
            start_time=self.start_time,
            end_time=self.end_time,
            instrumentation_scope=self.scope,
        )


class Capture:
    """What decides and exports: the rules, the ceiling, the SDK's processors, the counts."""

    def __init__(
        self,
        sampler: Sampler,
        processor: SpanProcessor,
        resource: Resource,
        rules: KeepRules,
        ids: IdGenerator,
    ) -> None:
        self.sampler = sampler
        self.ids = ids  # the provider's: a configured generator makes captured ids too
        self.processor = processor
        self.resource = resource
        self.rules = rules
        #: Processors told of every span's start and end, recorded or kept alike (the hub
        #: monitor's registry of open spans): ``add_span_processor`` of the provider.
        self.observers: list[Any] = []
        meter = metrics.get_meter("fanout.tracing")
        self._kept = meter.create_counter(
            "fanout.traces.kept", "{trace}", "Calls whose spans were exported, by why"
        )
        self._dropped = meter.create_counter(
            "fanout.traces.dropped",
            "{trace}",
            "Calls whose spans were not exported: ordinary, or past the ceiling of kept calls",
        )
        kept = ("panel", "shed", "cut", "error", "slow", "sampled")
        self._reasons = {reason: {"reason": reason} for reason in (*kept, "ordinary", "ceiling")}
        self._zeroed = False

    def _zero(self) -> None:
        """Every series at 0, at the first call: a rate over them is then 0, not absent.
        Not at start: the metrics may be set up after tracing, and a count added before
        is lost."""
        self._zeroed = True
        for reason, attributes in self._reasons.items():
            counter = self._dropped if reason in ("ordinary", "ceiling") else self._kept
            counter.add(0, attributes)

    def decide(self, record: CallRecord) -> bool:
        root = record.root
        assert root is not None and root.end_time is not None
        if not self._zeroed:
            self._zero()
        reason = keep_reason(record.spans, root, record.sampled, self.rules)
        if reason is None:
            self._dropped.add(1, self._reasons["ordinary"])
            return False
        if reason != "sampled" and not self.rules.ceiling.take():
            self._dropped.add(1, self._reasons["ceiling"])
            return False
        self._kept.add(1, self._reasons[reason])
        return True

    def export(self, spans: Sequence[CapturedSpan]) -> None:
        for span in spans:
            self.processor.on_end(span.readable(self.resource))


class _CapturingTracer(trace.Tracer):
    def __init__(self, capture: Capture, scope: InstrumentationScope) -> None:
        self._capture = capture
        self._scope = scope

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context)
        if type(parent) is CapturedSpan:  # a span of a call: the common case, kept short
            record, parent_context = parent.record, parent.context
            span_context = SpanContext(
                parent_context.trace_id,
                self._capture.ids.generate_span_id(),
                False,
                parent_context.trace_flags,
                parent_context.trace_state,
            )
        else:
            parent_context = parent.get_span_context()
            record, span_context = self._root(name, context, parent_context, kind, attributes)
        span = CapturedSpan(
            record,
            name,
            span_context,
            parent_context if parent_context.is_valid else None,
            kind,
            dict(attributes) if attributes else {},
            [link for link in links if link.context.is_valid] if links else (),
            start_time or span_time_ns(),
            self._scope,
        )
        if record.root is None and not record.decided:  # a new call's first span
            record.root = span
        for observer in self._capture.observers:
            observer.on_start(span, context)
        return span

    def _root(
        self,
        name: str,
        context: Context | None,
        parent: SpanContext,
        kind: SpanKind,
        attributes: Attributes,
    ) -> tuple[CallRecord, SpanContext]:
        ids = self._capture.ids
        trace_id = parent.trace_id if parent.is_valid else ids.generate_trace_id()
        decided = self._capture.sampler.should_sample(context, trace_id, name, kind, attributes)
        sampled = decided.decision is Decision.RECORD_AND_SAMPLE
        span_context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            False,
            _SAMPLED if sampled else _UNSAMPLED,
            decided.trace_state,
        )
        return CallRecord(self._capture, sampled), span_context

    @contextmanager
    def start_as_current_span(  # type: ignore[override]  # the API's decorator is private
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class CapturingProvider(trace.TracerProvider):
    """The global tracer provider under tail capture: its tracers record into calls."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self._tracers: dict[tuple[str, str | None, str | None], _CapturingTracer] = {}

    def add_span_processor(self, processor: Any) -> None:
        """Tell ``processor`` of every span's start and end (it gets the recorded span):
        what the SDK's provider does for its processors, for those that watch spans."""
        self.capture.observers.append(processor)

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> trace.Tracer:
        key = (instrumenting_module_name, instrumenting_library_version, schema_url)
        tracer = self._tracers.get(key)
        if tracer is None:
            # As the SDK makes it: no version is an empty one (Zipkin refuses a null tag).
            scope = InstrumentationScope(
                instrumenting_module_name,
                instrumenting_library_version or "",
                schema_url,
                attributes,
            )
            tracer = self._tracers[key] = _CapturingTracer(self.capture, scope)
        return tracer
