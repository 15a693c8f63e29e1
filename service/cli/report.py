"""Human-readable and JSON renderings of a ``StatsResponse``, for the CLI and the demo."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from service.idl import appstats

__all__ = ["format_response", "response_to_json", "outcomes_to_json"]

_STATUS_NAMES: dict[int, str] = dict(appstats.TaskStatus._VALUES_TO_NAMES)


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status, str(status))


def format_response(response: Any) -> str:
    """The panels, then the per-task outcomes, as aligned text."""
    lines = [
        f"app {response.app}   trace {response.trace_id or '-'}   "
        f"elapsed {response.elapsed_ms:.1f} ms",
        "",
        "Panels",
    ]
    panels = response.panels or {}
    for name in [o.name for o in response.outcomes or [] if o.name in panels]:
        lines.extend(_format_panel(name, panels[name]))
    lines += [
        "",
        "Outcomes",
        f"  {'panel':<12} {'source':<6} {'status':<9} {'elapsed_ms':>10}  error",
    ]
    for outcome in response.outcomes or []:
        error = f"{outcome.error_type}: {outcome.message}" if outcome.error_type else ""
        if error and outcome.retryable:
            error += " (retryable)"
        lines.append(
            f"  {outcome.name:<12} {outcome.source:<6} {status_name(outcome.status):<9} "
            f"{outcome.elapsed_ms:>10.1f}  {error}"
        )
    return "\n".join(lines)


def _format_panel(name: str, panel: Any) -> list[str]:
    if panel.error_summary is not None:
        summary = panel.error_summary
        lines = [f"  {name}: {summary.total} errors"]
        lines += [f"    {m.count:>6}  {m.message}" for m in summary.top]
    elif panel.top_list is not None:
        lines = [f"  {name}: {'count':>6} {'mean_ms':>9} {'total_ms':>11}  key"]
        lines += [
            f"    {' ' * len(name)}{e.count:>6} {e.mean_ms:>9.1f} {e.total_ms:>11.1f}  {e.key}"
            for e in panel.top_list.entries
        ]
    elif panel.series is not None:
        points = panel.series.points
        values = [p.value for p in points]
        shape = (
            f"min {min(values):.1f}, max {max(values):.1f}, last {values[-1]:.1f}"
            if values
            else "no points"
        )
        lines = [
            f"  {name}: {len(points)} points every {(panel.series.step_ms or 0) // 1000} s; {shape}"
        ]
    elif panel.alert_list is not None:
        lines = [f"  {name}: {len(panel.alert_list.alerts)} alerts"]
        lines += [
            f"    {_utc(a.triggered_ms)}  {a.severity:<8} {a.title}"
            for a in panel.alert_list.alerts
        ]
    else:
        lines = [f"  {name}: (empty)"]
    return lines


def _utc(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def response_to_json(response: Any) -> dict[str, Any]:
    """A JSON-ready dict of the response; enum values become their names."""
    return {
        "app": response.app,
        "trace_id": response.trace_id,
        "elapsed_ms": response.elapsed_ms,
        "panels": {name: _to_plain(panel) for name, panel in (response.panels or {}).items()},
        "outcomes": outcomes_to_json(response.outcomes),
    }


def outcomes_to_json(outcomes: Any) -> list[dict[str, Any]]:
    """Task outcomes, JSON-ready: an answer's, or a ``PanelFailed``'s."""
    return [{**_to_plain(o), "status": status_name(o.status)} for o in outcomes or []]


def _to_plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if hasattr(value, "thrift_spec"):
        return {
            spec[1]: _to_plain(getattr(value, spec[1]))
            for spec in value.thrift_spec.values()
            if getattr(value, spec[1]) is not None
        }
    return value
