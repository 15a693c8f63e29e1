"""The engine's metrics: task durations, the admission limit, and its counters.

Series (OpenTelemetry instruments; names as Prometheus shows them in brackets)::

    fanout.task.duration      histogram, s   one per outcome a caller got, by fanout.task.name, .source, .status
                                             [fanout_task_duration_seconds_*]
    fanout.admission.limit    gauge          the adaptive limit on calls in flight
    fanout.admission.inflight gauge          calls admitted and running
    fanout.admission.queued   gauge          calls waiting for admission
    fanout.calls.overloaded   counter        calls answered Overloaded (refused or no task started)
    fanout.calls.held         counter        ...of which held first: the caller ignored retry_after_ms
    fanout.tasks.started / .rejected / .abandoned / .killed   counters

Gauges and counters are read from the engines' own counters when a reader
collects, so the hot path pays for the histogram only, and nothing at all
while no meter provider is installed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from service.engine.outcomes import Task, TaskOutcome

__all__ = ["observe", "task_ended"]

_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_meter = metrics.get_meter("fanout.engine")
_task_duration = _meter.create_histogram(
    "fanout.task.duration", unit="s", description="Time from a task's start to its outcome")


def observe(engine: Any) -> None:
    """Publish ``engine``'s (a FanOut's) admission state and counters while it lives."""
    _engines.add(engine)


def task_ended(task: Task, outcome: TaskOutcome) -> None:
    """Record one task's duration and final status."""
    _task_duration.record(outcome.elapsed_ms / 1000.0, {
        "fanout.task.name": task.name, "fanout.task.source": task.source,
        "fanout.task.status": outcome.status.value})


def _read(value: Callable[[Any], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(value(engine) for engine in list(_engines)))]
    return callback


_meter.create_observable_gauge("fanout.admission.limit", [_read(lambda e: int(e.admission.limit))],
                               unit="{call}", description="The adaptive limit on calls in flight")
_meter.create_observable_gauge("fanout.admission.inflight", [_read(lambda e: e.admission.inflight)],
                               unit="{call}", description="Calls admitted and running")
_meter.create_observable_gauge("fanout.admission.queued", [_read(lambda e: e.admission.queued)],
                               unit="{call}", description="Calls waiting for admission")
for _name, _field, _unit, _description in (
        ("fanout.calls.overloaded", "overloaded", "{call}", "Calls answered Overloaded"),
        ("fanout.calls.held", "held", "{call}",
         "Overloaded answers held because the caller ignored retry_after_ms"),
        ("fanout.tasks.started", "started", "{task}", "Tasks started"),
        ("fanout.tasks.rejected", "rejected", "{task}", "Tasks that got no slot in time"),
        ("fanout.tasks.abandoned", "abandoned", "{task}", "Tasks still running when their call answered"),
        ("fanout.tasks.killed", "killed", "{task}", "Abandoned tasks killed after the grace period")):
    _meter.create_observable_counter(
        _name, [_read(lambda e, f=_field: getattr(e.stats, f))], unit=_unit, description=_description)
_meter.create_observable_counter(
    "fanout.tasks.coalesced", [_read(lambda e: e.coalescer.stats.followers)], unit="{task}",
    description="Tasks that shared an identical lookup's call instead of making their own")
