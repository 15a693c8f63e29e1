"""Goals and their verdicts: PASS when the point estimate meets the limit, GAP otherwise.

A verdict is taken on the point estimate; when the 95% interval straddles the
limit the row says so ("uncertain"), because on a shared 2-core machine a figure
that close to its limit can land on either side in the next run. Rows without a
limit are reported figures ("INFO"); rows whose configurations failed are "ERROR".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.analysis import stats

__all__ = [
    "Goal",
    "ratio_goal",
    "failures_goal",
    "monitor_goal",
    "value_goal",
    "info_row",
    "micro_goals",
]


@dataclass(frozen=True)
class Goal:
    scenario: str
    text: str
    verdict: str  # PASS | GAP | INFO | ERROR
    shown: str  # the figure as printed
    estimate: stats.Estimate | None = None
    limit: float | None = None
    at_most: bool = True
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "text": self.text,
            "verdict": self.verdict,
            "shown": self.shown,
            "limit": self.limit,
            "at_most": self.at_most,
            "estimate": self.estimate.as_dict() if self.estimate else None,
            "note": self.note,
        }


def _verdict(estimate: stats.Estimate, limit: float | None, at_most: bool) -> tuple[str, str]:
    if limit is None:
        return "INFO", ""
    met = estimate.value <= limit if at_most else estimate.value >= limit
    straddles = estimate.low <= limit <= estimate.high
    return ("PASS" if met else "GAP"), (
        "uncertain: the 95% interval contains the limit" if straddles else ""
    )


def _limit_text(limit: float | None, at_most: bool, unit: str = "x") -> str:
    if limit is None:
        return ""
    return f" (goal {'<=' if at_most else '>='} {limit:g}{unit})"


def ratio_goal(
    scenario: str,
    text: str,
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    limit: float | None,
    at_most: bool,
    note: str = "",
) -> Goal:
    """The ratio of the means of two configurations' per-repetition figures, with a
    bootstrap interval; ERROR when either side has no repetitions."""
    if not numerator or not denominator:
        return Goal(
            scenario,
            text + _limit_text(limit, at_most),
            "ERROR",
            "n/a",
            None,
            limit,
            at_most,
            "a configuration it needs did not run",
        )
    estimate = stats.bootstrap_ratio(list(numerator), list(denominator))
    if math.isnan(estimate.value):
        return Goal(
            scenario,
            text + _limit_text(limit, at_most),
            "GAP" if limit else "INFO",
            "0/0",
            estimate,
            limit,
            at_most,
            "both configurations measured zero",
        )
    verdict, caveat = _verdict(estimate, limit, at_most)
    shown = f"{estimate.value:.2f}x [{estimate.low:.2f}, {estimate.high:.2f}]"
    return Goal(
        scenario,
        text + _limit_text(limit, at_most),
        verdict,
        shown,
        estimate,
        limit,
        at_most,
        "; ".join(n for n in (note, caveat) if n),
    )


def failures_goal(
    scenario: str, text: str, result: dict[str, Any] | None, ignore: Sequence[str] = ()
) -> Goal:
    """Zero failed calls (transport errors, timeouts, exceptions, connect failures) over
    the whole run of one configuration, warm-up included; degraded replies are shown.
    Failure kinds in ``ignore`` (an expected ``overloaded``) are shown, not counted."""
    if not result or "failures_total" not in result:
        error = (result or {}).get("error", "did not run")
        return Goal(scenario, text + " (goal 0)", "ERROR", "n/a", note=error)
    failures = result["failures_total"]
    total = sum(n for kind, n in failures.items() if kind not in ignore)
    calls = sum(r["ok"] + r["degraded"] for r in result["reps"])
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(failures.items()))
    degraded = result.get("degraded_total", 0)
    note = f"{calls} measured calls; {degraded} degraded (some panel not OK)"
    if kinds:
        note += f"; failures: {kinds}"
    return Goal(
        scenario,
        text + " (goal 0)",
        "PASS" if total == 0 else "GAP",
        str(total),
        stats.Estimate(total, total, total, 1),
        0,
        True,
        note,
    )


def monitor_goal(scenario: str, results: dict[str, dict[str, Any]]) -> Goal:
    """Zero replies, over every Fanout configuration of ``scenario`` (its companion group
    included) and the whole of each run, with a panel that pymongo failed because its
    monitor's check was answered late."""
    runs = [
        r
        for key, r in results.items()
        if key.startswith(scenario + "/") and r and r.get("spec", {}).get("server") == "fanout"
    ]
    counted = [
        r["monitor_cut"] + r.get("companion", {}).get("monitor_cut", 0)
        for r in runs
        if "monitor_cut" in r
    ]
    text = "replies with a panel failed as too slow to answer pymongo's monitor (goal 0)"
    if not counted:
        return Goal(scenario, text, "ERROR", "n/a", note="no run counted them")
    total = sum(counted)
    return Goal(
        scenario,
        text,
        "PASS" if total == 0 else "GAP",
        str(total),
        stats.Estimate(total, total, total, 1),
        0,
        True,
        f"over {len(counted)} runs",
    )


def value_goal(
    scenario: str,
    text: str,
    estimate: stats.Estimate | None,
    unit: str,
    limit: float,
    note: str = "",
) -> Goal:
    """A measured value against an upper limit (micro-benchmarks)."""
    if estimate is None:
        return Goal(
            scenario,
            text + _limit_text(limit, True, " " + unit),
            "ERROR",
            "n/a",
            note=note or "not measured",
        )
    verdict, caveat = _verdict(estimate, limit, True)
    shown = f"{estimate.value:.1f} {unit}"
    if estimate.high > estimate.low:
        shown += f" [{estimate.low:.1f}, {estimate.high:.1f}]"
    return Goal(
        scenario,
        text + _limit_text(limit, True, " " + unit),
        verdict,
        shown,
        estimate,
        limit,
        True,
        "; ".join(n for n in (note, caveat) if n),
    )


def info_row(scenario: str, text: str, shown: str, note: str = "") -> Goal:
    return Goal(scenario, text, "INFO", shown, note=note)


def micro_goals(figures: dict[str, Any] | None, error: str = "") -> list[Goal]:
    """The goals on the figures of :func:`bench.micro.run_micro`: engine overhead, memory."""
    figures = figures or {}
    task = figures.get("task_overhead_us")
    p50 = (
        stats.Estimate(task["p50"], task["p50"], task["p50"], task.get("reps", 0)) if task else None
    )
    out = [
        value_goal(
            "micro",
            "per-task engine overhead p50, no tracing",
            p50,
            "us",
            25.0,
            note=(
                f"mean {task['mean']:.1f} +/- {task['ci95']:.1f} us, p99 {task['p99']:.1f} us"
                if task
                else error
            ),
        )
    ]
    for key, text, limit in (
        ("rss_per_idle_connection_kib", "RSS per idle connection", 16.0),
        ("rss_per_inflight_task_kib", "RSS per in-flight task", 12.0),
    ):
        memory = figures.get(key)
        estimate = (
            stats.Estimate(memory["mean"], memory["mean"], memory["mean"], 1) if memory else None
        )
        note = f"(during - before) / n over n = {memory['n']}" if memory else error
        out.append(value_goal("micro", text, estimate, "KiB", limit, note=note))
    spans = figures.get("span_cost_us")
    for key, text in (
        ("sdk", "CPU of one span, the OpenTelemetry SDK's own work (us, p50 of reps)"),
        ("encode", "...with Fanout's OTLP encoding (us)"),
        ("task_span", "...made by Fanout's task-span helper and encoded (us)"),
    ):
        shown = f"{spans[key]['p50']:.1f} +/- {spans[key]['ci95']:.1f}" if spans else "-"
        out.append(info_row("micro", text, shown, "" if spans else error))
    return out
