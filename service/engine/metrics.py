"""The engine's metrics: task durations and its counters (admission's are the gate's,
:mod:`service.overload.gate`).

Series (OpenTelemetry instruments; names as Prometheus shows them in brackets)::

    fanout.task.duration      histogram, s   one per outcome a caller got, by fanout.task.name, .source, .status
                                             [fanout_task_duration_seconds_*]
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

__all__ = ["observe", "observe_coalescing", "task_ended"]

_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_coalescers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_meter = metrics.get_meter("fanout.engine")
_task_duration = _meter.create_histogram(
    "fanout.task.duration", unit="s", description="Time from a task's start to its outcome")


def observe(engine: Any) -> None:
    """Publish ``engine``'s (a FanOut's) counters while it lives."""
    _engines.add(engine)


def observe_coalescing(coalescer: Any) -> None:
    """Publish ``coalescer``'s shared calls while it lives."""
    _coalescers.add(coalescer)


def task_ended(task: Task, outcome: TaskOutcome) -> None:
    """Record one task's duration and final status."""
    _task_duration.record(outcome.elapsed_ms / 1000.0, {
        "fanout.task.name": task.name, "fanout.task.source": task.source,
        "fanout.task.status": outcome.status.value})


def _read(value: Callable[[Any], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(value(engine) for engine in list(_engines)))]
    return callback


for _name, _field, _unit, _description in (
        ("fanout.tasks.started", "started", "{task}", "Tasks started"),
        ("fanout.tasks.rejected", "rejected", "{task}", "Tasks that got no slot in time"),
        ("fanout.tasks.abandoned", "abandoned", "{task}", "Tasks still running when their call answered"),
        ("fanout.tasks.killed", "killed", "{task}", "Abandoned tasks killed after the grace period")):
    _meter.create_observable_counter(
        _name, [_read(lambda e, f=_field: getattr(e.stats, f))], unit=_unit, description=_description)
_meter.create_observable_counter(
    "fanout.tasks.coalesced",
    [lambda options: [Observation(sum(c.stats.followers for c in list(_coalescers)))]],
    unit="{task}",
    description="Tasks that shared an identical lookup's call instead of making their own")
