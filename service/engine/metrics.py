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


from opentelemetry import metrics

from service.engine.outcomes import Task, TaskOutcome

__all__ = ["task_ended"]

_meter = metrics.get_meter("fanout.engine")
_task_duration = _meter.create_histogram(
    "fanout.task.duration", unit="s", description="Time from a task's start to its outcome")


def task_ended(task: Task, outcome: TaskOutcome) -> None:
    """Record one task's duration and final status."""
    _task_duration.record(outcome.elapsed_ms / 1000.0, {
        "fanout.task.name": task.name, "fanout.task.source": task.source,
        "fanout.task.status": outcome.status.value})
