"""Translation from engine and lookup values to Thrift types. Only the handler calls this."""

from __future__ import annotations

from typing import Any, Iterable

from lookups.panels import AlertList, ErrorSummary, PanelValue, Series, TopList
from service.idl import appstats
from service.engine.outcomes import TaskOutcome

__all__ = ["to_panel_data", "to_thrift_outcome", "to_thrift_outcomes"]


def to_panel_data(value: PanelValue) -> Any:
    """The ``PanelData`` union member for one panel value.

    Raises ``TypeError`` for a value of no known panel type (a lookup bug).
    """
    if isinstance(value, ErrorSummary):
        return appstats.PanelData(error_summary=appstats.ErrorSummary(
            total=value.total,
            top=[appstats.MessageCount(message=m.message, count=m.count) for m in value.top]))
    if isinstance(value, TopList):
        return appstats.PanelData(top_list=appstats.TopList(entries=[
            appstats.TopEntry(key=e.key, count=e.count, mean_ms=e.mean_ms, total_ms=e.total_ms)
            for e in value.entries]))
    if isinstance(value, Series):
        return appstats.PanelData(series=appstats.Series(
            points=[appstats.Point(ts_ms=p.ts_ms, value=p.value) for p in value.points],
            step_ms=value.step_ms))
    if isinstance(value, AlertList):
        return appstats.PanelData(alert_list=appstats.AlertList(alerts=[
            appstats.Alert(id=a.id, severity=a.severity, title=a.title, triggered_ms=a.triggered_ms)
            for a in value.alerts]))
    raise TypeError(f"no Thrift mapping for panel value of type {type(value).__name__}")


def to_thrift_outcome(outcome: TaskOutcome) -> Any:
    return appstats.TaskOutcome(
        name=outcome.name, source=outcome.source,
        status=getattr(appstats.TaskStatus, outcome.status.value),
        elapsed_ms=round(outcome.elapsed_ms, 3), error_type=outcome.error_type,
        message=outcome.message, retryable=outcome.retryable)


def to_thrift_outcomes(outcomes: Iterable[TaskOutcome]) -> list[Any]:
    return [to_thrift_outcome(o) for o in outcomes]
