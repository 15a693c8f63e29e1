"""What every scenario is made of: its scale, its configurations, and the helpers that
read repetitions out of results. The catalog of scenarios is ``scenarios.py``; the
scenarios in ``cost.py``, ``overload.py``, ``pythons.py`` and the others build on this module too."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.analysis.goals import Goal, ratio_goal
from bench.harness.runner import Config, panel_names

__all__ = [
    "SATURATING_CONNECTIONS",
    "SERVERS",
    "Results",
    "Scale",
    "Scenario",
    "SINGLE_INTERVAL_S",
    "over_slowest_lookup",
    "result_key",
    "rps_and_cpu_goals",
]

SINGLE_INTERVAL_S = 0.1
#: A closed loop this wide keeps one server process's CPU busy, yet no lookup runs into its
#: timeout.
SATURATING_CONNECTIONS = 20
SERVERS = ("fanout", "sequential", "threaded")
Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Scale:
    """Full or quick: which levels run, and how long the paced scenarios are."""

    quick: bool

    def levels(self, full: tuple[int, ...], quick: tuple[int, ...]) -> tuple[int, ...]:
        return quick if self.quick else full


@dataclass
class Scenario:
    name: str
    title: str
    configs: list[Config]
    goals: Callable[[Results], list[Goal]]
    notes: list[str] = field(default_factory=list)


def _spec(**kwargs: Any) -> Any:
    from bench.harness.stack import StackSpec

    return StackSpec(**kwargs)


def result_key(scenario: str, label: str, connections: int) -> str:
    """The key of a configuration's result: its scenario, its label, its connections."""
    return f"{scenario}/{label}/c{connections}"


def _config(
    scenario: str, server: str, call: str, connections: int, *, label: str = "", **kwargs: Any
) -> Config:
    spec_keys = {
        "mongo",
        "delay_ms",
        "workers",
        "tracing",
        "pool_size",
        "admission",
        "coalesce",
        "merge_commands",
        "python",
        "brownout",
        "fair_share",
        "callers",
        "hub_monitor",
        "http_fail_every",
        "tail_max_per_s",
    }
    spec = _spec(server=server, **{k: v for k, v in kwargs.items() if k in spec_keys})
    rest = {k: v for k, v in kwargs.items() if k not in spec_keys}
    return Config(
        key=result_key(scenario, label or server, connections),
        scenario=scenario,
        label=label or server,
        spec=spec,
        call=call,
        connections=connections,
        **rest,
    )


def rps_and_cpu_goals(
    scenario: str,
    texts: tuple[str, str],
    top: dict[str, Any] | None,
    bottom: dict[str, Any] | None,
    limits: tuple[float | None, float | None] = (None, None),
) -> list[Goal]:
    """Two ratios of ``top`` over ``bottom``: calls a second (at least ``limits[0]``) and
    the server's CPU per reply (at most ``limits[1]``), named ``texts``."""
    return [
        ratio_goal(
            scenario,
            texts[0],
            _per_rep(top, "rps"),
            _per_rep(bottom, "rps"),
            limit=limits[0],
            at_most=False,
        ),
        ratio_goal(
            scenario,
            texts[1],
            _cpu_ms_per_reply(top),
            _cpu_ms_per_reply(bottom),
            limit=limits[1],
            at_most=True,
        ),
    ]


def over_slowest_lookup(
    scenario: str,
    text: str,
    calls: dict[str, Any] | None,
    pct: str,
    single: dict[str, Any] | None,
    limit: float | None,
) -> Goal:
    """``pct`` latency of ``calls`` over the p50 of the slowest panel asked for alone
    (``single``: a "stats_each_panel" result), with its interval."""
    slowest = _slowest_panel(single)
    return ratio_goal(
        scenario,
        text,
        _per_rep(calls, f"{pct}_ms"),
        _per_rep_frame(single, slowest, "p50_ms"),
        limit=limit,
        at_most=True,
        note="" if slowest is None else f"slowest lookup: {panel_names()[slowest]}",
    )


def _slowest_panel(single: dict[str, Any] | None) -> int | None:
    if not single or "pooled" not in single:
        return None
    p50s = [f["p50_ms"] for f in single["pooled"]["frames"]]
    valid = [(v, i) for i, v in enumerate(p50s) if not math.isnan(v)]
    return max(valid)[1] if valid else None


def _per_rep(result: dict[str, Any] | None, key: str) -> list[float]:
    if not result or "reps" not in result:
        return []
    return [r[key] for r in result["reps"] if not math.isnan(r.get(key, math.nan))]


def _cpu_ms_per_reply(result: dict[str, Any] | None) -> list[float]:
    """Per repetition, the server's CPU milliseconds per reply (complete or degraded)."""
    if not result or "reps" not in result:
        return []
    return [
        10.0 * r["cpu_pct"]["server"] / r["replies_per_s"]
        for r in result["reps"]
        if r.get("replies_per_s")
    ]


def _per_rep_frame(result: dict[str, Any] | None, frame: int | None, key: str) -> list[float]:
    if frame is None or not result or "reps" not in result:
        return []
    values = [r["frames"][frame][key] for r in result["reps"]]
    return [v for v in values if not math.isnan(v)]
