"""The brownout scenario: 50 CRITICAL callers, alone and beside 1,000 SHEDDABLE ones.

In both regimes of the overload scenario (``cpu``: 20 ms backends; ``pool``: 200 ms
backends and pools of 64), 50 closed-loop CRITICAL callers that honour
``retry_after_ms`` run:

* ``alone``;
* ``mixed``: beside 1,000 SHEDDABLE callers that try again 50 ms after an
  ``Overloaded``, whatever it asked;
* ``ignored``: the same mixed load against the server before brownout (no
  criticality sent, ``admission.brownout = false``): today's behaviour.

Then callers that set no criticality (plain Apache clients): 1,000 of them ignoring
``retry_after_ms``, with brownout on and off; 5 callers, below capacity; and in the
``cpu`` regime 200 CRITICAL callers paced to offer 0.8x to 2x the calls a second that
the 50 callers alone got, for the share of optional panels served as the load falls
(a closed loop of callers keeps a queue standing at any load past capacity, and the
dimmer holds on a standing queue: only a paced load falls). Every reply of the primary
group is decoded: its goodput counts the calls whose essential panels were all OK. The
server's dimmer is read every half second (:mod:`bench.harness.mixed`).

``alone`` and ``mixed``, whose ratio is the goal, run in turn: :data:`ROUNDS` rounds of
each, a third of the repetitions a round (:mod:`bench.harness.rounds`), so that the
machine's drift weighs on both alike; the goals join each one's rounds, and an info row
gives the ratio of every round.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from bench.analysis.goals import Goal, info_row, monitor_goal, ratio_goal
from bench.harness.mixed import Companion
from bench.harness.overload import REGIMES
from bench.harness.rounds import (
    failures_of,
    interleaved,
    merged,
    p99s,
    round_label,
    round_ratios,
    rounds_of,
)
from bench.harness.runner import Config
from bench.harness.scenario import Results, Scale, Scenario, _config

__all__ = ["brownout"]

NAME = "brownout"
CRITICAL_CALLERS = 50
SHEDDABLE_CALLERS = 1000
PAUSE_S = 0.05
WARMUP_S = 8.0
#: The paced sweep: CRITICAL callers offering these shares of the complete calls a second
#: the 50 callers alone got (cpu), from below capacity to past it.
SWEEP = (0.8, 1.2, 1.4, 1.6, 2.0)
PACED_CALLERS = 200
#: Rounds of ``alone`` and ``mixed`` in turn (one in a quick run).
ROUNDS = 3


def _round(regime: str, name: str, companion: Companion | None, n: int, share: float) -> Config:
    """Round ``n`` of the critical callers, alone or with ``companion`` (for ``interleaved``)."""
    return _run(
        round_label(name, n), regime, CRITICAL_CALLERS, companion=companion, reps_share=share
    )


def _run(
    label: str,
    regime: str,
    connections: int,
    criticality: str = "CRITICAL",
    companion: Companion | None = None,
    brownout: bool = True,
    **kwargs: Any,
) -> Config:
    delay, pool = REGIMES[regime]
    honour = kwargs.pop("honour_retry_after", True)
    return _config(
        NAME,
        "fanout",
        "stats_essential",
        connections,
        label=f"{label}-{regime}",
        delay_ms=delay,
        pool_size=pool,
        brownout=brownout,
        criticality=criticality,
        companion=companion or Companion(),
        honour_retry_after=honour,
        decode_every=1,
        warmup_s=WARMUP_S,
        window_scale=2.0,
        **kwargs,
    )


def _configs(scale: Scale) -> list[Config]:
    sheddable = Companion(SHEDDABLE_CALLERS, "SHEDDABLE", overloaded_pause_s=PAUSE_S)
    today = Companion(SHEDDABLE_CALLERS, "", overloaded_pause_s=PAUSE_S)
    configs = []
    for regime in REGIMES:
        configs += interleaved(
            1 if scale.quick else ROUNDS,
            functools.partial(_round, regime, "alone", None),
            functools.partial(_round, regime, "mixed", sheddable),
        )
        configs.append(_run("ignored", regime, CRITICAL_CALLERS, "", today, brownout=False))
        for on in (True, False):
            configs.append(
                _run(
                    f"plain-{'on' if on else 'off'}",
                    regime,
                    SHEDDABLE_CALLERS,
                    "",
                    brownout=on,
                    honour_retry_after=False,
                    overloaded_pause_s=PAUSE_S,
                )
            )
    configs.append(_run("below", "cpu", 5))
    for share in SWEEP if not scale.quick else ():
        configs.append(
            _run(
                f"paced{int(share * 100)}",
                "cpu",
                PACED_CALLERS,
                capacity_fraction=share,
                capacity_of=_key(round_label("alone", 1), "cpu"),
            )
        )
    return configs


def _key(label: str, regime: str, connections: int = CRITICAL_CALLERS) -> str:
    return f"{NAME}/{label}-{regime}/c{connections}"


def _essential_per_s(result: dict[str, Any] | None) -> list[float]:
    return list(((result or {}).get("essential") or {}).get("per_s") or [])


def _essential_lost(result: dict[str, Any] | None) -> int:
    essential = (result or {}).get("essential") or {}
    return sum(essential.get("answers", [])) - sum(essential.get("essential_ok", []))


def _optional_share(result: dict[str, Any] | None) -> str:
    """The share of optional panels served: to the primary group, and to the companion."""
    essential = (result or {}).get("essential") or {}
    asked = sum(essential.get("optional_asked", []))
    primary = sum(essential.get("optional_run", [])) / asked if asked else math.nan
    companion = (result or {}).get("companion") or {}
    windows = companion.get("windows") or []
    whole = sum(w["whole"] for w in windows)
    answered = whole + sum(w["lighter"] for w in windows)
    return f"CRITICAL {primary:.2f}" + (
        f", SHEDDABLE {whole / answered:.2f} of {answered} answered" if answered else ""
    )


def _level_range(result: dict[str, Any] | None) -> str:
    """The dimmer's range over the measured windows (the warm-up left out)."""
    levels = [
        level for t, level in (result or {}).get("brownout_levels", []) if t >= WARMUP_S + 1.0
    ]
    if not levels:
        return "n/a"
    return f"{min(levels):.2f} to {max(levels):.2f} (mean {sum(levels) / len(levels):.2f})"


def _order_breaches(result: dict[str, Any] | None) -> int:
    """Windows in which a CRITICAL call was refused or lost an essential panel while a
    SHEDDABLE call got a whole answer."""
    reps = (result or {}).get("reps", [])
    essential = (result or {}).get("essential") or {}
    lost = [
        a - ok for a, ok in zip(essential.get("answers", []), essential.get("essential_ok", []))
    ]
    whole = [w["whole"] for w in ((result or {}).get("companion") or {}).get("windows", [])]
    return sum(
        1
        for i, rep in enumerate(reps)
        if (rep["failures"].get("overloaded", 0) or (lost[i] if i < len(lost) else 0))
        and i < len(whole)
        and whole[i]
    )


def _goals(results: Results) -> list[Goal]:
    out: list[Goal] = []
    for regime in REGIMES:
        key = functools.partial(_key, regime=regime)
        alones = rounds_of(results, key, "alone", ROUNDS)
        mixeds = rounds_of(results, key, "mixed", ROUNDS)
        alone, mixed = merged(alones), merged(mixeds)
        ignored = results.get(_key("ignored", regime))
        out.append(
            ratio_goal(
                NAME,
                f"CRITICAL goodput (essential panels OK), mixed / alone ({regime})",
                _essential_per_s(mixed),
                _essential_per_s(alone),
                limit=0.95,
                at_most=False,
            )
        )
        out.append(
            info_row(
                NAME,
                f"CRITICAL goodput, mixed / alone, each round in turn ({regime})",
                ", ".join(f"{r:.2f}x" for r in round_ratios(mixeds, alones, _essential_per_s)),
            )
        )
        out.append(
            ratio_goal(
                NAME,
                f"CRITICAL p99, mixed / alone ({regime})",
                p99s(mixed),
                p99s(alone),
                limit=1.5,
                at_most=True,
            )
        )
        out.append(
            ratio_goal(
                NAME,
                f"CRITICAL goodput, today's server (criticality ignored) / alone ({regime})",
                _essential_per_s(ignored),
                _essential_per_s(alone),
                limit=None,
                at_most=False,
            )
        )
        out.append(
            _zero(f"CRITICAL late answers, mixed ({regime})", mixed, failures_of(mixed, "timeout"))
        )
        out.append(
            info_row(
                NAME,
                f"CRITICAL calls refused / short of an essential panel: alone, mixed ({regime})",
                f"{failures_of(alone, 'overloaded')} / {_essential_lost(alone)}, "
                f"{failures_of(mixed, 'overloaded')} / {_essential_lost(mixed)}",
            )
        )
        out.append(
            _zero(
                f"windows breaking the order (a CRITICAL call refused or short while a "
                f"SHEDDABLE call was served whole), mixed ({regime})",
                mixed,
                _order_breaches(mixed),
            )
        )
        plain_on = results.get(_key("plain-on", regime, SHEDDABLE_CALLERS))
        plain_off = results.get(_key("plain-off", regime, SHEDDABLE_CALLERS))
        out.append(
            ratio_goal(
                NAME,
                f"callers with no criticality: goodput of essential panels, "
                f"brownout on / off ({regime})",
                _essential_per_s(plain_on),
                _essential_per_s(plain_off),
                limit=1.0,
                at_most=False,
            )
        )
        for label, result in (
            ("alone", alone),
            ("mixed", mixed),
            ("ignored", ignored),
            ("plain-on", plain_on),
            ("plain-off", plain_off),
        ):
            out.append(
                info_row(
                    NAME,
                    f"{label} {regime}: dimmer; optional panels served; answers",
                    f"{_level_range(result)}; {_optional_share(result)}; {_answers(result)}",
                )
            )
    below = results.get(_key("below", "cpu", 5))
    essential = (below or {}).get("essential") or {}
    out.append(
        _zero(
            "answers short of a panel, or calls refused, below capacity (5 callers, cpu)",
            below,
            sum(essential.get("answers", []))
            - sum(essential.get("whole", []))
            + failures_of(below, "overloaded"),
        )
    )
    for share in SWEEP:
        result = results.get(_key(f"paced{int(share * 100)}", "cpu", PACED_CALLERS))
        if result:
            out.append(
                info_row(
                    NAME,
                    f"{PACED_CALLERS} CRITICAL callers paced to {share:.1f}x the "
                    f"calls/s of 50 alone (cpu): dimmer; optional panels "
                    f"served; answers",
                    f"{_level_range(result)}; {_optional_share(result)}; {_answers(result)}",
                )
            )
    out.append(monitor_goal(NAME, results))
    return out


def _answers(result: dict[str, Any] | None) -> str:
    if not result or "reps" not in result:
        return (result or {}).get("error", "did not run")
    essential = result.get("essential") or {}
    ok = sum(essential.get("whole", []))
    lighter = sum(essential.get("essential_ok", [])) - ok
    companion = result.get("companion") or {}
    p99s = result.get("rounds_p99_ms") or [result["pooled"]["p99_ms"]]
    text = (
        f"primary: whole {ok}, lighter {lighter}, refused {failures_of(result, 'overloaded')}, "
        f"late {failures_of(result, 'timeout')}, p99 {' / '.join(f'{p:.0f}' for p in p99s)} ms"
    )
    if companion.get("windows"):
        whole = sum(w["whole"] for w in companion["windows"])
        lighter = sum(w["lighter"] for w in companion["windows"])
        text += (
            f"; companion: whole {whole}, lighter {lighter}, refused {companion['refused']},"
            f" late {companion['late']}"
        )
    return text


def _zero(text: str, result: dict[str, Any] | None, count: int) -> Goal:
    if not result or "reps" not in result:
        return Goal(
            NAME,
            text + " (goal 0)",
            "ERROR",
            "n/a",
            note=(result or {}).get("error", "did not run"),
        )
    return Goal(NAME, text + " (goal 0)", "PASS" if count == 0 else "GAP", str(count))


def brownout(scale: Scale) -> Scenario:
    notes = [
        f"{CRITICAL_CALLERS} closed-loop CRITICAL callers honouring retry_after_ms; "
        f"{SHEDDABLE_CALLERS} SHEDDABLE callers trying again {PAUSE_S * 1000:.0f} ms after "
        f"an Overloaded; 1 s windows after {WARMUP_S:.0f} s of warm-up; regimes as in the "
        f"overload scenario. Optional panels: controllers, queries, volume."
    ]
    return Scenario(
        NAME, "Brownout: criticality and optional panels", _configs(scale), _goals, notes
    )
