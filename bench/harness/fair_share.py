"""The fair-share scenario: one caller's storm beside a caller asking for 30% of capacity.

In both regimes of the overload scenario (``cpu``: 20 ms backends; ``pool``: 200 ms
backends and pools of 64), every call ``CRITICAL`` (the same criticality), each group of
callers naming itself in ``RequestMeta.caller``:

* ``storm``: caller ``storm``, 1,000 callers trying again 50 ms after an ``Overloaded``
  whatever ``retry_after_ms`` says, alone: the capacity (its complete calls a second), and
  all of it is the storm's when it is alone (work-conserving);
* ``polite``: caller ``polite``, 50 callers asking together for 30% of that capacity at a
  steady pace (one call per period each, none tried again after an ``Overloaded``), alone;
* ``beside``: ``polite`` beside ``storm``;
* ``pair``: two callers of 500 such naive callers each, with equal weights, and with
  ``[callers.heavy] weight = 3`` against ``light``.

``polite`` and ``beside``, whose ratio is the goal, run in turn (:mod:`bench.harness.rounds`).
A complete call is one whose essential panels are all OK (the dimmer may shed the optional
ones). The per-call cost of fairness (finding the caller, its share, its counts) is timed
apart, against the CPU a call costs the server in ``storm``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

from bench.analysis.goals import Goal, info_row, ratio_goal
from bench.analysis.stats import mean_or_nan
from bench.harness.mixed import Companion
from bench.harness.overload import REGIMES
from bench.harness.rounds import (
    failures_of,
    interleaved,
    merged,
    p99s,
    round_label,
    round_ratios_shown,
    rounds_of,
)
from bench.harness.runner import Config
from bench.harness.scenario import Results, Scale, Scenario, _config

__all__ = ["fair_share"]

NAME = "fair"
POLITE_CALLERS = 50
POLITE_SHARE = 0.3  # of the capacity the storm alone measured
STORM_CALLERS = 1000
PAIR_CALLERS = 500
PAUSE_S = 0.05
WARMUP_S = 8.0
ROUNDS = 3
WEIGHTS = (("heavy", 3.0),)


def _run(label: str, regime: str, connections: int, caller: str, **kwargs: Any) -> Config:
    delay, pool = REGIMES[regime]
    return _config(
        NAME,
        "fanout",
        "stats_essential",
        connections,
        label=f"{label}-{regime}",
        delay_ms=delay,
        pool_size=pool,
        caller=caller,
        warmup_s=WARMUP_S,
        window_scale=2.0,
        **kwargs,
    )


def _naive(caller: str) -> dict[str, Any]:
    return {"overloaded_pause_s": PAUSE_S, "honour_retry_after": False, "caller": caller}


def _companion(connections: int, caller: str) -> Companion:
    return Companion(connections, overloaded_pause_s=PAUSE_S, caller=caller, call="stats_essential")


def _polite_round(regime: str, name: str, beside: bool, n: int, share: float) -> Config:
    """Round ``n`` of the polite callers alone or beside the storm (for ``interleaved``)."""
    return _polite(regime, round_label(name, n), share, beside)


def _polite(regime: str, label: str, share: float, beside: bool) -> Config:
    return _run(
        label,
        regime,
        POLITE_CALLERS,
        "polite",
        capacity_fraction=POLITE_SHARE,
        capacity_of=_key("storm", regime, STORM_CALLERS),
        companion=_companion(STORM_CALLERS, "storm") if beside else Companion(),
        reps_share=share,
    )


def _configs(scale: Scale) -> list[Config]:
    configs = []
    for regime in REGIMES:
        configs.append(_run("storm", regime, STORM_CALLERS, **_naive("storm")))
        configs += interleaved(
            1 if scale.quick else ROUNDS,
            functools.partial(_polite_round, regime, "polite", False),
            functools.partial(_polite_round, regime, "beside", True),
        )
        for label, weights in (("pair-equal", ()), ("pair-weighted", WEIGHTS)):
            configs.append(
                _run(
                    label,
                    regime,
                    PAIR_CALLERS,
                    companion=_companion(PAIR_CALLERS, "light"),
                    callers=weights,
                    **_naive("heavy"),
                )
            )
    return configs


def _key(label: str, regime: str, connections: int = POLITE_CALLERS) -> str:
    return f"{NAME}/{label}-{regime}/c{connections}"


def _rates(result: dict[str, Any] | None) -> list[float]:
    """Complete calls a second (essential panels OK), per window."""
    return [r["rps"] for r in (result or {}).get("reps", []) if "rps" in r]


def _companion_rates(result: dict[str, Any] | None, window_s: float) -> list[float]:
    windows = ((result or {}).get("companion") or {}).get("windows") or []
    return [w["whole"] / window_s for w in windows]


def _window_s(result: dict[str, Any] | None) -> float:
    return float((result or {}).get("window_s") or 1.0)


def _goals(results: Results) -> list[Goal]:
    out: list[Goal] = []
    for regime in REGIMES:
        out += _beside_goals(results, regime)
        out += _pair_goals(results, regime)
    out.append(_cost_goal(results))
    return out


def _beside_goals(results: Results, regime: str) -> list[Goal]:
    storm = results.get(_key("storm", regime, STORM_CALLERS))
    key = functools.partial(_key, regime=regime)
    alones = rounds_of(results, key, "polite", ROUNDS)
    besides = rounds_of(results, key, "beside", ROUNDS)
    alone, beside = merged(alones), merged(besides)
    capacity = _rates(storm)
    together = [
        polite + hog
        for polite, hog in zip(
            _rates(beside), _companion_rates(beside, _window_s(besides[0] if besides else None))
        )
    ]
    return [
        ratio_goal(
            NAME,
            f"polite caller's goodput beside the storm / alone ({regime})",
            _rates(beside),
            _rates(alone),
            limit=0.95,
            at_most=False,
        ),
        info_row(
            NAME,
            f"polite caller's goodput, beside / alone, each round in turn ({regime})",
            round_ratios_shown(besides, alones, _rates),
        ),
        ratio_goal(
            NAME,
            f"polite caller's p99, beside the storm / alone ({regime})",
            p99s(beside),
            p99s(alone),
            limit=1.5,
            at_most=True,
        ),
        _zero(f"polite caller's late answers beside the storm ({regime})", beside, "timeout"),
        _zero(f"polite caller's refusals beside the storm ({regime})", beside, "overloaded"),
        _zero(f"polite caller's refusals alone, below capacity ({regime})", alone, "overloaded"),
        ratio_goal(
            NAME,
            f"goodput of both callers together / the storm alone (work-conserving, {regime})",
            together,
            capacity,
            limit=0.95,
            at_most=False,
        ),
        info_row(
            NAME,
            f"complete calls a second: storm alone; polite alone, beside; storm beside ({regime})",
            f"{mean_or_nan(capacity):.0f}; {mean_or_nan(_rates(alone)):.0f}, {mean_or_nan(_rates(beside)):.0f}; "
            f"{mean_or_nan(_companion_rates(beside, _window_s(besides[0] if besides else None))):.0f}",
        ),
    ]


def _pair_goals(results: Results, regime: str) -> list[Goal]:
    out = []
    for label, weights, expected in (
        ("pair-equal", "equal weights", 1.0),
        ("pair-weighted", "weights 3:1", 3.0),
    ):
        result = results.get(_key(label, regime, PAIR_CALLERS))
        heavy, light = _rates(result), _companion_rates(result, _window_s(result))
        ratio = ratio_goal(
            NAME,
            f"two saturating callers, {weights}: goodput of heavy / "
            f"({expected:g} x light) ({regime}; goal within 10% of 1)",
            [rate / expected for rate in heavy],
            light,
            limit=None,
            at_most=False,
        )
        out.append(_within(ratio, 0.9, 1.1))
    return out


def _within(goal: Goal, low: float, high: float) -> Goal:
    """``goal`` (a ratio shown as info) judged two-sided: PASS when its estimate lies in
    [low, high]."""
    if goal.estimate is None or math.isnan(goal.estimate.value):
        return goal
    inside = low <= goal.estimate.value <= high
    return dataclasses.replace(goal, verdict="PASS" if inside else "GAP")


def _cost_goal(results: Results) -> Goal:
    """The per-call work of fairness, timed here, over the server's CPU per call (storm, cpu)."""
    storm = results.get(_key("storm", "cpu", STORM_CALLERS))
    reps = (storm or {}).get("reps", [])
    per_call = [
        r["cpu_pct"].get("server", 0.0) / 100.0 / r["replies_per_s"]
        for r in reps
        if r.get("replies_per_s")
    ]
    if not per_call:
        return Goal(NAME, "CPU of fairness per call / a call's (goal <= 2%)", "ERROR", "n/a")
    share = fairness_cost_s() / mean_or_nan(per_call)
    return Goal(
        NAME,
        "CPU of fairness per call / a call's CPU (goal <= 2%)",
        "PASS" if share <= 0.02 else "GAP",
        f"{100 * share:.2f}%",
    )


def fairness_cost_s(callers: int = 1000, calls: int = 200_000) -> float:
    """Seconds of CPU fairness adds to one admitted call: finding its caller among
    ``callers`` active ones, its share, and its counts in and out."""
    from lookups.clock import SYSTEM_CLOCK
    from service.overload.fair_share import FairShare

    shares = FairShare({}, max_callers=callers, clock=SYSTEM_CLOCK)
    names = [f"caller-{n}" for n in range(callers)]
    started = time.process_time()
    for n in range(calls):
        share = shares.arrived(names[n % callers])
        shares.over(share, 100.0)
        shares.admitted(share)
        shares.done(share)
    return (time.process_time() - started) / calls


def _zero(text: str, result: dict[str, Any] | None, kind: str) -> Goal:
    if not result or "reps" not in result:
        note = (result or {}).get("error", "did not run")
        return Goal(NAME, text + " (goal 0)", "ERROR", "n/a", note=note)
    count = failures_of(result, kind)
    return Goal(NAME, text + " (goal 0)", "PASS" if count == 0 else "GAP", str(count))


def fair_share(scale: Scale) -> Scenario:
    notes = [
        f"caller polite: {POLITE_CALLERS} callers paced to {POLITE_SHARE:.0%} of the complete "
        f"calls/s the storm alone got, none tried again after an Overloaded; caller storm: "
        f"{STORM_CALLERS} callers trying again {PAUSE_S * 1000:.0f} ms after an Overloaded; "
        f"pairs: {PAIR_CALLERS} such callers each. All CRITICAL; complete = essential panels "
        f"OK; 2 s windows after {WARMUP_S:.0f} s of warm-up; regimes as in the overload "
        "scenario."
    ]
    return Scenario(NAME, "Fair share per caller", _configs(scale), _goals, notes)
