"""The steady-storm scenario's goals (:mod:`bench.harness.steady`), from results made up
here: the spread of the storm's windows, and the CPU spent refusing in each round."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness.rounds import round_label
from bench.harness.scenario import Scale
from bench.harness.steady import (
    BASE_CALLERS,
    CALLERS,
    NAME,
    ROUNDS,
    steady_storm,
)


def window(rps: float, server_pct: float, refused: int = 0) -> dict[str, Any]:
    return {
        "rps": rps,
        "replies_per_s": rps,
        "cpu_pct": {"server": server_pct},
        "failures": {"overloaded": refused} if refused else {},
    }


def results(
    storm_rates: list[float], base: tuple[float, float], storm: tuple[float, float, int]
) -> dict[str, Any]:
    """The storm's windows at ``storm_rates``; every round's run without a storm at
    ``base`` (complete calls a second, server CPU %) and with one at ``storm`` (the same,
    and refusals in a 2 s window)."""
    found: dict[str, Any] = {
        f"{NAME}/storm/c{CALLERS}": {
            "window_s": 60.0,
            "reps": [window(rate, 100.0) for rate in storm_rates],
            "states": [{"limit": 12, "brownout_level": 0.6} for _ in storm_rates],
        }
    }
    for n in range(1, ROUNDS + 1):
        found[f"{NAME}/{round_label('base', n)}/c{BASE_CALLERS}"] = {
            "window_s": 2.0,
            "reps": [window(*base)] * 2,
        }
        found[f"{NAME}/{round_label('refusing', n)}/c{CALLERS}"] = {
            "window_s": 2.0,
            "reps": [window(*storm)] * 2,
        }
    return found


def goals_of(found: dict[str, Any]) -> dict[str, Any]:
    goals = steady_storm(Scale(quick=False)).goals(found)
    return {goal.text.split(" (goal")[0]: goal for goal in goals}


def test_a_storm_whose_windows_hold_still_and_whose_refusals_cost_little_passes() -> None:
    # 200 calls at a whole core: 5 ms each. Beside the storm, 190 calls take 0.95 of it:
    # 0.05 of a core refuses 500 calls a second (1,000 in a 2 s window), 100 us each.
    goals = goals_of(results([200, 205, 198, 202, 200], (200, 100), (190, 100, 1000)))
    spread = goals["storm: complete calls a second over the windows, max - min over the mean"]
    assert (spread.verdict, spread.shown) == ("PASS", "3.5%")
    refusing = goals["storm: server CPU spent refusing, share of a core"]
    assert refusing.verdict == "PASS" and refusing.shown.startswith("5.0%")
    assert goals["CPU one refusal costs in the storm"].shown == "100 us"
    assert (
        "12, 12, 12, 12, 12"
        in goals["storm: admission limit; brownout level, at each window's end"].shown
    )


def test_a_storm_whose_capacity_moves_or_whose_refusals_take_a_tenth_is_a_gap() -> None:
    goals = goals_of(results([150, 200, 250, 200, 200], (200, 100), (180, 100, 1000)))
    spread = goals["storm: complete calls a second over the windows, max - min over the mean"]
    assert (spread.verdict, spread.shown) == ("GAP", "50.0%")
    refusing = goals["storm: server CPU spent refusing, share of a core"]
    assert refusing.verdict == "GAP" and refusing.shown.startswith("10.0%")


def test_a_storm_that_did_not_run_is_an_error_not_a_pass() -> None:
    goals = steady_storm(Scale(quick=False)).goals({})
    assert {goal.verdict for goal in goals} == {"INFO", "ERROR"}
    assert any(goal.verdict == "ERROR" for goal in goals)


@pytest.mark.parametrize("quick", [False, True])
def test_the_storm_runs_its_windows_and_the_rounds_take_turns(quick: bool) -> None:
    configs = steady_storm(Scale(quick=quick)).configs
    labels = [config.label for config in configs]
    rounds = 1 if quick else ROUNDS
    assert labels[0] == "storm" and configs[0].states
    assert labels[1:] == [
        label
        for n in range(1, rounds + 1)
        for label in (f"base-r{n}", f"refusing-r{n}")[:: 1 if n % 2 else -1]
    ]
    assert all(not config.spec.brownout for config in configs[1:])
    assert configs[0].spec.brownout
