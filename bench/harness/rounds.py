"""Interleaved rounds: two configurations measured in turn, a few rounds each, and each
one's rounds merged back into one result for the goals.

This machine's pace drifts by several percent from one minute to the next, as much as
the effects some goals weigh (the manual's Performance page gives the runs). A ratio of two configurations
run one after the other then says as much of the drift as of the configurations; run in
turn, both see the same drift. The turns go back and forth (A, B, B, A, A, B, ...): a
configuration run always just after another would carry the drift of that place in the
round, and of what ran before it. :func:`interleaved` builds the rounds;
:func:`merged` joins one configuration's rounds (their windows one after another, as if
one run); :func:`round_ratios` gives the ratio of each round, for how far they spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.analysis.stats import ratio_of_means

__all__ = [
    "interleaved",
    "merged",
    "round_ratios",
    "round_label",
    "rounds_of",
    "p99s",
    "failures_of",
]

#: Per-window lists of a result that the rounds' windows extend.
_ESSENTIAL = ("per_s", "answers", "essential_ok", "whole", "optional_run", "optional_asked")


def round_label(label: str, n: int) -> str:
    """The label of round ``n`` (from 1) of the configuration ``label``."""
    return f"{label}-r{n}"


def rounds_of(
    results: Mapping[str, dict[str, Any]], key: Callable[[str], str], label: str, rounds: int
) -> list[dict[str, Any] | None]:
    """The rounds of ``label`` that ran, in order (one in a quick run); ``key`` gives the
    result's key of a round's label."""
    found = [results.get(key(round_label(label, n))) for n in range(1, rounds + 1)]
    return found[:1] if found[0] is not None and (rounds < 2 or found[1] is None) else found


def p99s(result: dict[str, Any] | None) -> list[float]:
    """Each window's p99 latency (ms) of a result, the empty windows left out."""
    return [r["p99_ms"] for r in (result or {}).get("reps", []) if not math.isnan(r["p99_ms"])]


def failures_of(result: dict[str, Any] | None, kind: str) -> int:
    """Calls of a result that failed as ``kind`` (``overloaded``, ``timeout``), all windows."""
    return sum(r["failures"].get(kind, 0) for r in (result or {}).get("reps", []))


def interleaved(rounds: int, *make: Callable[[int, float], Any]) -> list[Any]:
    """``rounds`` rounds of the configurations ``make`` builds, in turn, every other round
    in the reverse order: each gets the round's number and its share of the repetitions
    (1 / ``rounds``)."""
    return [
        build(n, 1.0 / rounds)
        for n in range(1, rounds + 1)
        for build in (make if n % 2 else make[::-1])
    ]


def merged(results: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One result from the rounds of one configuration: the windows, the decoded replies'
    per-window figures, the companion's windows and the dimmer's levels of every round,
    in order. A round missing or failed makes the whole an error."""
    for result in results:
        if result is None or "reps" not in result:
            return {"error": (result or {}).get("error", "a round did not run")}
    ran = [r for r in results if r is not None]
    out: dict[str, Any] = {
        "reps": [rep for r in ran for rep in r["reps"]],
        "rounds_p99_ms": [r["pooled"]["p99_ms"] for r in ran],
        "brownout_levels": [lv for r in ran for lv in r.get("brownout_levels", [])],
    }
    essentials = [r.get("essential") or {} for r in ran]
    if any(essentials):
        out["essential"] = {
            key: [v for e in essentials for v in e.get(key, [])] for key in _ESSENTIAL
        }
    companions = [r.get("companion") or {} for r in ran]
    if any(c.get("windows") for c in companions):
        out["companion"] = {
            "windows": [w for c in companions for w in c.get("windows", [])],
            "refused": sum(c.get("refused", 0) for c in companions),
            "late": sum(c.get("late", 0) for c in companions),
        }
    return out


def round_ratios(
    numerators: Sequence[dict[str, Any] | None],
    denominators: Sequence[dict[str, Any] | None],
    figure: Callable[[dict[str, Any] | None], list[float]],
) -> list[float]:
    """Per round, the mean of ``figure`` over the numerator's windows over the
    denominator's (NaN for a round where either measured nothing)."""
    ratios = []
    for top, bottom in zip(numerators, denominators):
        a, b = figure(top), figure(bottom)
        ratios.append(ratio_of_means(a, b) if a and b and sum(b) else math.nan)
    return ratios


def round_ratios_shown(
    numerators: Sequence[dict[str, Any] | None],
    denominators: Sequence[dict[str, Any] | None],
    figure: Callable[[dict[str, Any] | None], list[float]],
) -> str:
    """:func:`round_ratios` as a goal row shows them: ``1.02x, 0.97x, 1.00x``."""
    return ", ".join(f"{r:.2f}x" for r in round_ratios(numerators, denominators, figure))
