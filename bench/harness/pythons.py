"""The ``python`` scenario: the same server on each CPython found on the machine.

Tests and every other scenario run on the interpreter the benchmark runs on (the
project's minimum). This scenario also serves from each newer CPython it finds:

- ``python3.N`` on the ``PATH`` for N above the running minor version;
- pyenv's versions (``$PYENV_ROOT``, else ``~/.pyenv``), not its shims;
- or exactly the interpreters in ``FANOUT_BENCH_PYTHONS`` (``:``-separated paths).

Only the server runs on the other interpreter; the backends and the load generator
stay on the benchmark's, so a ratio compares the server alone. Each interpreter gets
a virtual environment in ``build/bench-pythons/cpython-X.Y.Z`` holding this project
(editable) and the very versions of its dependencies the benchmark's own environment
has (as pip constraints), made once and remade when ``pyproject.toml`` or those
versions change. An interpreter whose environment cannot be made is reported as an
ERROR row, and the others still run.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.analysis.goals import Goal, info_row, ratio_goal
from bench.harness.interpreters import PYTHONS_ENV, find_newer_pythons, server_interpreter
from bench.harness.scenario import Scale, Scenario, _config, _cpu_ms_per_reply, _per_rep

__all__ = ["PYTHONS_ENV", "find_newer_pythons", "server_interpreter", "python_versions"]

CONNECTIONS = 20


def _label(version: tuple[int, ...]) -> str:
    return "cpython-" + ".".join(map(str, version))


def python_versions(scale: Scale) -> Scenario:
    name = "python"
    minimum = _label(tuple(sys.version_info[:3]))
    newer = find_newer_pythons()
    configs = [_config(name, "fanout", "stats", CONNECTIONS, label=minimum)]
    configs += [
        _config(name, "fanout", "stats", CONNECTIONS, label=_label(v), python=path)
        for v, path in newer.items()
    ]

    def goals(results: dict[str, dict[str, Any]]) -> list[Goal]:
        base = results.get(f"{name}/{minimum}/c{CONNECTIONS}")
        out: list[Goal] = []
        for version in newer:
            other = results.get(f"{name}/{_label(version)}/c{CONNECTIONS}")
            if other and other.get("error"):
                out.append(
                    Goal(
                        name,
                        f"{_label(version)}: could not serve",
                        "ERROR",
                        "n/a",
                        note=other["error"][:300],
                    )
                )
                continue
            out.append(
                ratio_goal(
                    name,
                    f"server CPU per call, {_label(version)} / {minimum}",
                    _cpu_ms_per_reply(other),
                    _cpu_ms_per_reply(base),
                    limit=None,
                    at_most=True,
                )
            )
            out.append(
                ratio_goal(
                    name,
                    f"calls/s, {_label(version)} / {minimum}",
                    _per_rep(other, "rps"),
                    _per_rep(base, "rps"),
                    limit=None,
                    at_most=False,
                )
            )
        if not newer:
            out.append(
                info_row(
                    name,
                    "newer CPython found",
                    "none",
                    note=f"looked on PATH and in pyenv; set {PYTHONS_ENV} to choose",
                )
            )
        return out

    notes = [
        f"Closed loop of get_app_stats at {CONNECTIONS} connections (20 ms backends, tracing "
        f"off), the server on each CPython found ({minimum} is the interpreter the benchmark "
        "and the tests run on); the backends and load generator stay on that one. Each "
        "other interpreter serves from build/bench-pythons/, with the same dependency "
        "versions."
    ]
    return Scenario(name, "Python versions", configs, goals, notes)
