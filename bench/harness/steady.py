"""The steady-storm scenario: does capacity hold still under a long storm, and what do its
refusals cost?

One caller's storm alone, in the ``cpu`` regime of the overload scenario (20 ms
backends; the core bounds throughput): 1,000 callers trying again 50 ms after an
``Overloaded`` whatever ``retry_after_ms`` says, every call ``CRITICAL``. Its goals:

* **Capacity holds still.** Five one-minute windows of the storm (five short ones with
  ``--quick``) after the warm-up, as shipped: the complete calls a second of each window
  and their spread (max - min over the mean), with the admission limit and the dimmer's
  level at each window's end.
* **Refusals cost little.** The server's CPU spent refusing, in cores: in rounds taken in
  turn, the storm's server CPU less what its complete calls cost at the CPU per complete
  call of the round's run without a storm (50 callers in a closed loop that honour
  ``retry_after_ms``); and that over the storm's refusals a second, the CPU one refusal
  costs. Both runs of a round saturate the core, with the dimmer off so that every call
  does the same work: the rest is what the refusals take from the calls.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from bench.analysis.goals import Goal, info_row
from bench.analysis.stats import mean_or_nan
from bench.harness.overload import REGIMES
from bench.harness.rounds import interleaved, round_label, rounds_of
from bench.harness.runner import Config
from bench.harness.scenario import Results, Scale, Scenario, _config, _per_rep

__all__ = ["steady_storm"]

NAME = "steady"
CALLERS = 1000
PAUSE_S = 0.05
WARMUP_S = 8.0
#: Windows of the storm and their length, in full and quick runs.
WINDOWS, WINDOW_S = 5, 60.0
QUICK_WINDOWS, QUICK_WINDOW_S = 5, 6.0
#: The run without a storm: callers in a closed loop.
BASE_CALLERS = 50
#: The refusal cost's rounds, and the length and number of their windows against a run's
#: base timing: 3 rounds of 2 windows of 6 s each (a quick run: 1 round, 2 windows of 3.6 s).
ROUNDS, ROUND_WINDOW_SCALE, ROUND_REPS_SHARE = 3, 12.0, 0.2
#: The goals: the windows' spread, and the share of a core spent refusing.
SPREAD_GOAL = 0.10
REFUSING_GOAL = 0.05


def _timing(scale: Scale) -> tuple[float, float]:
    """``(reps_share, window_scale)`` for the storm's windows, from a run's base timing
    (:mod:`bench.__main__`: 30 windows of 0.5 s, or 5 of 0.3 s)."""
    base_reps, base_window_s = (5, 0.3) if scale.quick else (30, 0.5)
    windows, window_s = (QUICK_WINDOWS, QUICK_WINDOW_S) if scale.quick else (WINDOWS, WINDOW_S)
    return windows / base_reps, window_s / base_window_s


def _run(label: str, connections: int, **kwargs: Any) -> Config:
    delay, pool = REGIMES["cpu"]
    return _config(
        NAME,
        "fanout",
        "stats_essential",
        connections,
        label=label,
        delay_ms=delay,
        pool_size=pool,
        caller="storm",
        warmup_s=WARMUP_S,
        **kwargs,
    )


def _round(label: str, storm: bool, n: int, share: float) -> Config:
    """Round ``n`` of the refusal cost's runs, the storm or the run without one (dimmer off)."""
    kwargs: dict[str, Any] = (
        {"overloaded_pause_s": PAUSE_S} if storm else {"honour_retry_after": True}
    )
    return _run(
        round_label(label, n),
        CALLERS if storm else BASE_CALLERS,
        brownout=False,
        window_scale=ROUND_WINDOW_SCALE,
        reps_share=share * ROUND_REPS_SHARE,
        **kwargs,
    )


def _configs(scale: Scale) -> list[Config]:
    reps_share, window_scale = _timing(scale)
    storm = _run(
        "storm",
        CALLERS,
        states=True,
        overloaded_pause_s=PAUSE_S,
        window_scale=window_scale,
        reps_share=reps_share,
    )
    return [
        storm,
        *interleaved(
            1 if scale.quick else ROUNDS,
            functools.partial(_round, "base", False),
            functools.partial(_round, "refusing", True),
        ),
    ]


def _reps(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((result or {}).get("reps", []))


def _refusals_per_s(result: dict[str, Any] | None) -> list[float]:
    window_s = float((result or {}).get("window_s") or math.nan)
    return [r["failures"].get("overloaded", 0) / window_s for r in _reps(result)]


def _server_cores(result: dict[str, Any] | None) -> list[float]:
    return [r["cpu_pct"].get("server", math.nan) / 100.0 for r in _reps(result)]


def cpu_per_call_s(result: dict[str, Any] | None) -> float:
    """Server CPU seconds per complete call, over a result's windows."""
    calls = sum(_per_rep(result, "rps"))
    return sum(_server_cores(result)) / calls if calls else math.nan


def _goals(results: Results) -> list[Goal]:
    storm = results.get(f"{NAME}/storm/c{CALLERS}")
    rates = _per_rep(storm, "rps")
    out = [
        info_row(
            NAME,
            "storm: complete calls a second, each window",
            ", ".join(f"{r:.0f}" for r in rates),
        )
    ]
    if not rates:
        note = (storm or {}).get("error", "did not run")
        return [*out, Goal(NAME, "storm's windows", "ERROR", "n/a", note=note)]
    spread = (max(rates) - min(rates)) / mean_or_nan(rates)
    out.append(
        Goal(
            NAME,
            f"storm: complete calls a second over the windows, max - min over the mean "
            f"(goal <= {SPREAD_GOAL:.0%})",
            "PASS" if spread <= SPREAD_GOAL else "GAP",
            f"{spread:.1%}",
        )
    )
    states = (storm or {}).get("states", [])
    out.append(
        info_row(
            NAME,
            "storm: admission limit; brownout level, at each window's end",
            ", ".join(str(state.get("limit")) for state in states)
            + "; "
            + ", ".join(f"{state.get('brownout_level') or 0:.2f}" for state in states),
        )
    )
    return [*out, *_refusal_goals(results)]


def _refusal_goals(results: Results) -> list[Goal]:
    bases = rounds_of(results, lambda label: f"{NAME}/{label}/c{BASE_CALLERS}", "base", ROUNDS)
    storms = rounds_of(results, lambda label: f"{NAME}/{label}/c{CALLERS}", "refusing", ROUNDS)
    refusing: list[float] = []
    refused: list[float] = []
    per_call: list[float] = []
    for base, storm in zip(bases, storms):
        if not _reps(base) or not _reps(storm):
            continue
        per_call_s = cpu_per_call_s(base)
        rates = _per_rep(storm, "rps")
        cores = _server_cores(storm)
        refusing.append(mean_or_nan(cores) - mean_or_nan(rates) * per_call_s)
        refused.append(mean_or_nan(_refusals_per_s(storm)))
        per_call.append(per_call_s)
    if not refusing:
        return [Goal(NAME, "server CPU spent refusing", "ERROR", "n/a", note="did not run")]
    share = mean_or_nan(refusing)
    return [
        info_row(
            NAME,
            "refusal cost, each round: storm's refusals a second; CPU per complete call "
            "without a storm; server CPU spent refusing (cores)",
            "; ".join(
                f"{r:.0f}/s, {c * 1e3:.2f} ms, {x:.3f}"
                for r, c, x in zip(refused, per_call, refusing)
            ),
        ),
        info_row(
            NAME,
            "CPU one refusal costs in the storm",
            f"{share / mean_or_nan(refused) * 1e6:.0f} us",
        ),
        Goal(
            NAME,
            f"storm: server CPU spent refusing, share of a core (goal <= {REFUSING_GOAL:.0%})",
            "PASS" if share <= REFUSING_GOAL else "GAP",
            f"{share:.1%} (rounds " + ", ".join(f"{x:.1%}" for x in refusing) + ")",
        ),
    ]


def steady_storm(scale: Scale) -> Scenario:
    windows, window_s = (QUICK_WINDOWS, QUICK_WINDOW_S) if scale.quick else (WINDOWS, WINDOW_S)
    notes = [
        f"caller storm alone: {CALLERS} callers trying again {PAUSE_S * 1000:.0f} ms after an "
        f"Overloaded; all CRITICAL; complete = essential panels OK; {windows} windows of "
        f"{window_s:.0f} s after {WARMUP_S:.0f} s of warm-up; the cpu regime of the overload "
        f"scenario. The refusal cost: {ROUNDS} rounds in turn of the storm and of "
        f"{BASE_CALLERS} callers in a closed loop honouring retry_after_ms, dimmer off."
    ]
    return Scenario(NAME, "A steady storm", _configs(scale), _goals, notes)
