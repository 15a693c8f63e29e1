"""The benchmark's choice of interpreters for the ``python`` scenario (no environments made)."""

from __future__ import annotations

import sys

import pytest

from bench.harness.pythons import PYTHONS_ENV, find_newer_pythons, python_versions
from bench.harness.scenarios import Scale
from bench.harness.stack import StackSpec


def test_the_listed_interpreters_are_taken_by_version_and_broken_ones_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PYTHONS_ENV, f"/bin/false:{sys.executable}:/no/such/python3.99")
    assert find_newer_pythons() == {tuple(sys.version_info[:3]): sys.executable}


def test_the_scenario_runs_the_minimum_and_each_interpreter_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PYTHONS_ENV, sys.executable)
    scenario = python_versions(Scale(quick=True))
    minimum = "cpython-" + ".".join(map(str, sys.version_info[:3]))
    assert [c.spec.python for c in scenario.configs] == ["", sys.executable]
    assert scenario.configs[0].label == minimum
    # With no results the ratios have nothing to compare: an ERROR row each, never a PASS.
    assert {g.verdict for g in scenario.goals({})} == {"ERROR"}


def test_none_found_is_said_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHONS_ENV, "")
    scenario = python_versions(Scale(quick=True))
    assert len(scenario.configs) == 1
    [row] = scenario.goals({})
    assert (row.verdict, row.shown) == ("INFO", "none")


def test_only_the_fanout_server_takes_another_interpreter() -> None:
    with pytest.raises(ValueError, match="python"):
        StackSpec(server="threaded", python=sys.executable)
