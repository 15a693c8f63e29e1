"""The AppStats RPC handler: validate, enter context, plan, fan out, map to Thrift.

One method per IDL method. This is the only layer that knows both the Thrift
types and the engine; declared Thrift exceptions leave from here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from lookups.base import Lookup
from lookups.cache.panel import CachedPanel
from lookups.deadline import Deadline
from lookups.panels import AlertList, ErrorSummary, PanelValue, Series, TopList, Window
from service.engine.coalescing import Coalescer
from service.engine.tasks import (
    FanOutOverloaded,
    RequestContext,
    RequiredTaskFailed,
    Task,
    TaskOutcome,
    TaskStatus,
    current_request_id,
    new_request_id,
)
from service.idl import appstats
from service.operations.snapshot import ServiceParts, take
from service.overload.pacing import current_connection
from service.rpc.merged import merged_calls
from service.rpc.pool_report import group_report, own_report, to_thrift
from service.rpc.validation import ValidRequest, validate_stats_request
from service.settings.config import Settings
from tracing.spans import (
    mark_admitted,
    mark_coalesced,
    request_span,
    skipped_task_span,
    trace_id_hex,
)

__all__ = ["AppStatsHandler", "to_panel_data", "to_thrift_outcome", "to_thrift_outcomes"]

log = logging.getLogger(__name__)


class AppStatsHandler:
    """Serves ``AppStats`` from a set of lookups, through one shared :class:`FanOut`.

    ``lookups`` maps every panel this server offers to its lookup, in display
    order; which of them run, their timeouts and whether each is required come
    from ``settings.lookups``. ``parts`` are what it runs calls through and reports
    on (the engine, the gate, the coalescer, the health checker, the clock);
    ``draining`` says whether the server is draining.

    Four arguments, each of a different kind: what to serve (``lookups``), how
    (``settings``), through what (``parts``, built before the handler), and the one fact
    of the server, which is built after it (``draining``).
    """

    def __init__(
        self,
        settings: Settings,
        lookups: Mapping[str, Lookup],
        parts: ServiceParts,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self._settings = settings
        self._lookups = dict(lookups)
        # Each panel's policy and timeout, read once: settings do not change under a server.
        self._policies = {name: settings.lookup(name) for name in self._lookups}
        self._timeouts_ms = {name: settings.task_timeout_ms(name) for name in self._lookups}
        self._enabled = [name for name in self._lookups if self._policies[name].enabled]
        self._parts = parts
        self._clock = parts.clock
        self._fanout, self._gate, self._coalescer = parts.fanout, parts.gate, parts.coalescer
        self._draining = draining
        #: In a pre-forked group, the worker's line to the group (service.workers.member):
        #: ``pool_stats()`` then answers for every worker.
        self.group: Any | None = None

    def ping(self) -> str:
        with _method_span("ping"):
            return "pong"

    def health(self) -> Any:
        """Serving state and each backend's reachability (checked in parallel, cached ~1 s),
        then the results cache's shared store's when it is Redis (named ``cache``)."""
        with _method_span("health"):
            return self._health_report()

    def _health_report(self) -> Any:
        statuses = (*self._parts.health.check(), *self._parts.stores())
        state = (
            appstats.ServingState.DRAINING if self._draining() else appstats.ServingState.SERVING
        )
        return appstats.Health(
            state=state,
            backends=[
                appstats.BackendHealth(
                    name=s.name,
                    up=s.up,
                    latency_ms=s.latency_ms,
                    detail=s.detail or None,
                    circuit=s.circuit,
                )
                for s in statuses
            ],
        )

    def pool_stats(self) -> Any:
        """Every pool's use over the rolling window, with its recommended size."""
        with _method_span("pool_stats"):
            return self._pool_report()

    def _pool_report(self) -> Any:
        own = own_report(take(self._parts))
        if self.group is None:
            return to_thrift(own)
        return group_report(self.group.position, {**self.group.pools(), self.group.position: own})

    def panels(self) -> list[str]:
        """The panels this server can gather (enabled ones only)."""
        with _method_span("panels"):
            return self._enabled_panels()

    def _enabled_panels(self) -> list[str]:
        return list(self._enabled)

    def panel_info(self) -> list[Any]:
        """The panels :meth:`panels` names, each with whether it is optional or required."""
        with _method_span("panel_info"):
            return [
                appstats.PanelInfo(
                    name=name,
                    source=self._lookups[name].source,
                    is_optional=self._policies[name].optional,
                    is_required=self._policies[name].required,
                )
                for name in self._enabled
            ]

    def get_app_stats(self, request: Any) -> Any:
        """Gather the requested panels.

        The SERVER span covers validation too: an invalid request's span has
        status ERROR and ``fanout.invalid_field`` naming the field.

        Raises ``InvalidRequest`` for bad input, ``Overloaded`` when no panel could
        start, ``PanelFailed`` when a required panel failed.
        """
        started = self._clock.monotonic()
        # Not validated yet: request_span's extract_context tolerates any junk here.
        caller_headers = getattr(getattr(request, "meta", None), "headers", None) or {}
        request_id = new_request_id()
        current_request_id.set(request_id)
        with request_span("get_app_stats", caller_headers, request_id) as span:
            try:
                valid = validate_stats_request(
                    request, list(self._lookups), self._enabled_panels(), self._settings.fanout
                )
            except appstats.InvalidRequest as invalid:
                if span.is_recording():
                    span.set_attribute("fanout.invalid_field", invalid.field or "")
                raise
            if span.is_recording():
                span.set_attribute("fanout.criticality", valid.criticality.name)
                span.set_attribute("fanout.fresh", valid.fresh)
                if valid.request_id:
                    span.set_attribute("fanout.request_id", valid.request_id)
            context = RequestContext.start(
                "get_app_stats",
                valid.deadline_ms,
                valid.request_id or request_id,
                valid.headers,
                clock=self._clock,
            )
            current_request_id.set(context.request_id)
            outcomes = self._gather(valid, context)
            return appstats.StatsResponse(
                app=valid.window.app,
                panels={o.name: o.value for o in outcomes if o.ok},
                outcomes=to_thrift_outcomes(outcomes),
                trace_id=trace_id_hex(span),
                elapsed_ms=round((self._clock.monotonic() - started) * 1000.0, 3),
            )

    def _gather(self, valid: ValidRequest, context: RequestContext) -> list[TaskOutcome]:
        skipped: list[TaskOutcome] = []
        try:
            with self._gate.admitted(
                context.deadline, current_connection.get(), valid.criticality, valid.caller
            ) as call:
                if call.ticket.caller is not None:
                    mark_admitted(call.ticket.caller.name, call.ticket.caller.weight)
                tasks, skipped = self._plan(valid, call.lighter)  # a refusal plans nothing
                result = self._fanout.run(tasks, context.by(call.deadline))
                call.ran(o.status for o in result.outcomes)
        # Declared exceptions are logged once, by the server, with the rest of their kind.
        except FanOutOverloaded as overloaded:
            raise appstats.Overloaded(
                message=str(overloaded), retry_after_ms=overloaded.retry_after_ms
            ) from None
        except RequiredTaskFailed as failed:
            outcomes = self._in_order(valid, failed.result.outcomes, skipped)
            raise appstats.PanelFailed(
                message=str(failed), panel=failed.failed.name, outcomes=to_thrift_outcomes(outcomes)
            ) from None
        return self._in_order(valid, result.outcomes, skipped)

    def _in_order(
        self, valid: ValidRequest, ran: Sequence[TaskOutcome], skipped: list[TaskOutcome]
    ) -> list[TaskOutcome]:
        """Every outcome the caller gets, in request order; the skipped ones counted here."""
        for outcome in skipped:
            self._parts.skipped[_BROWNOUT if outcome.error_type == BROWNOUT else "disabled"] += 1
        by_name = {o.name: o for o in (*ran, *skipped)}
        return [by_name[name] for name in valid.panels if name in by_name]

    def _plan(self, valid: ValidRequest, lighter: bool) -> tuple[list[Task], list[TaskOutcome]]:
        skipped: list[TaskOutcome] = []
        planned: dict[str, Lookup] = {}
        for name in valid.panels:
            lookup, policy = self._lookups[name], self._policies[name]
            if not policy.enabled or (lighter and policy.optional):
                skipped.append(_skipped(name, lookup.source, shed=policy.enabled))
                continue
            if valid.fresh and isinstance(lookup, CachedPanel):
                lookup = lookup.inner  # the panel's own query: no cached bucket is read
            planned[name] = lookup
        coalescer = self._coalescer
        merged = (
            merged_calls(planned, valid.window, coalescer, to_panel_data)
            if self._settings.fanout.merge_commands
            else {}
        )
        tasks = [
            Task(
                name=name,
                source=lookup.source,
                call=merged.get(name) or _panel_call(lookup, valid.window, coalescer),
                timeout_ms=self._timeouts_ms[name],
                required=self._policies[name].required,
                optional=self._policies[name].optional,
            )
            for name, lookup in planned.items()
        ]
        return tasks, skipped


#: ``error_type`` of a panel shed under load, and its reason in the skipped panels' metric.
BROWNOUT, _BROWNOUT = "Brownout", "brownout"


def _skipped(name: str, source: str, shed: bool) -> TaskOutcome:
    """A panel not run: shed under load (retryable), or disabled on this server."""
    if shed:
        skipped_task_span(name, source, _BROWNOUT)
        return TaskOutcome(
            name,
            source,
            TaskStatus.SKIPPED,
            0.0,
            error_type=BROWNOUT,
            message="shed under load (brownout): ask again shortly",
            retryable=True,
        )
    skipped_task_span(name, source, "disabled")
    return TaskOutcome(name, source, TaskStatus.SKIPPED, 0.0, message="disabled on this server")


def _method_span(method: str) -> AbstractContextManager[Any]:
    """The SERVER span of a method that carries no trace context: a root of its own."""
    return request_span(method, {}, new_request_id())


def _panel_call(
    lookup: Lookup, window: Window, coalescer: Coalescer | None
) -> Callable[[Deadline], Any]:
    """The task body: fetch (sharing an identical call in flight, when coalescing), then map
    to Thrift inside the task, so a bad value is that task's ERROR."""
    if coalescer is None:

        def call(deadline: Deadline) -> Any:
            return to_panel_data(lookup.fetch(window, deadline))

        return call
    # The whole question: the panel, the window (app, start, end), and whether buckets are
    # read (a fresh call never joins one that reads them). Nothing else is shared.
    key = (lookup.name, window, isinstance(lookup, CachedPanel))

    def shared_call(deadline: Deadline) -> Any:
        return to_panel_data(
            coalescer.call(
                key, deadline, lambda: lookup.fetch(window, deadline), joined=mark_coalesced
            )
        )

    return shared_call


# Translation from engine and lookup values to Thrift types.
def to_panel_data(value: PanelValue) -> Any:
    """The ``PanelData`` union member for one panel value.

    Raises ``TypeError`` for a value of no known panel type (a lookup bug).
    """
    if isinstance(value, ErrorSummary):
        return appstats.PanelData(
            error_summary=appstats.ErrorSummary(
                total=value.total,
                top=[appstats.MessageCount(message=m.message, count=m.count) for m in value.top],
            )
        )
    if isinstance(value, TopList):
        return appstats.PanelData(
            top_list=appstats.TopList(
                entries=[
                    appstats.TopEntry(
                        key=e.key, count=e.count, mean_ms=e.mean_ms, total_ms=e.total_ms
                    )
                    for e in value.entries
                ]
            )
        )
    if isinstance(value, Series):
        return appstats.PanelData(
            series=appstats.Series(
                points=[appstats.Point(ts_ms=p.ts_ms, value=p.value) for p in value.points],
                step_ms=value.step_ms,
            )
        )
    if isinstance(value, AlertList):
        return appstats.PanelData(
            alert_list=appstats.AlertList(
                alerts=[
                    appstats.Alert(
                        id=a.id, severity=a.severity, title=a.title, triggered_ms=a.triggered_ms
                    )
                    for a in value.alerts
                ]
            )
        )
    raise TypeError(f"no Thrift mapping for panel value of type {type(value).__name__}")


def to_thrift_outcome(outcome: TaskOutcome) -> Any:
    return appstats.TaskOutcome(
        name=outcome.name,
        source=outcome.source,
        status=getattr(appstats.TaskStatus, outcome.status.value),
        elapsed_ms=round(outcome.elapsed_ms, 3),
        error_type=outcome.error_type,
        message=outcome.message,
        retryable=outcome.retryable,
    )


def to_thrift_outcomes(outcomes: Iterable[TaskOutcome]) -> list[Any]:
    return [to_thrift_outcome(o) for o in outcomes]
