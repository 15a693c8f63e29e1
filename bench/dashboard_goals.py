"""The dashboard bench's goals, from one run's figures (:mod:`bench.dashboard`).

Per engine, the cached run against the uncached one: the database's work and the p50
(FerretDB 2: the cache does what it promises; nx-27017: it never costs more than no
cache), and Fanout's CPU per refresh, idle included. On FerretDB 2, the Redis runs too:
answers exact, the hit ratio shared as alone, and a Redis killed failing nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.analysis.stats import bootstrap_ratio

__all__ = ["dashboard_goals"]

#: The most each engine's cached run may cost in database work and p50, over uncached.
AT_MOST = {"ferretdb": (0.05, 0.2), "nx-27017": (1.0, 1.0)}


def dashboard_goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, by engine, from the engines ``results`` holds."""
    goals: dict[str, Any] = {}
    for engine, (work_at_most, p50_at_most) in AT_MOST.items():
        if engine not in results:
            continue
        runs = results[engine]
        goals[engine] = _cached_against_uncached(runs, work_at_most, p50_at_most)
        if "shared" in runs:
            goals[engine].update(_redis(runs))
    return goals


def _cached_against_uncached(
    runs: dict[str, Any], work_at_most: float, p50_at_most: float
) -> dict[str, Any]:
    plain, cached = runs["uncached"], runs["cached"]

    def per_window(key: str) -> dict[str, float]:
        """cached / uncached of ``key`` over the runs' refresh windows, with its interval."""
        return bootstrap_ratio(
            [w[key] for w in cached["windows"]], [w[key] for w in plain["windows"]]
        ).as_dict()

    return {
        f"database work, cached / uncached, engine's idle off (at most {work_at_most})": cached[
            "db_cpu_ms_per_call"
        ]
        / plain["db_cpu_ms_per_call"],
        "database work, cached / uncached, raw": cached["db_cpu_ms_per_call_raw"]
        / plain["db_cpu_ms_per_call_raw"],
        "database work per window, cached / uncached": per_window("db_cpu_ms_per_call"),
        f"p50, cached / uncached (at most {p50_at_most})": cached["p50_ms"] / plain["p50_ms"],
        "p50 with its interval": bootstrap_ratio(
            cached["latencies_ms"], plain["latencies_ms"], statistic=statistics.median
        ).as_dict()
        if cached["latencies_ms"] and plain["latencies_ms"]
        else "no call answered whole on one side",
        "Fanout CPU per call, idle included, cached / uncached (at most 1.2)": cached[
            "fanout_cpu_ms_per_call_with_idle"
        ]
        / plain["fanout_cpu_ms_per_call_with_idle"],
        "Fanout CPU per window, idle off, cached / uncached": per_window("fanout_cpu_ms_per_call"),
        "windows the panels' own queries answered, cached run": cached["query_windows"],
        "timings of the measured plan run meanwhile, cached run": cached.get("timings", 0.0),
        "failed calls, cached run (0)": sum(cached["failed"].values()),
        "uncached run's failed calls (0: served without overload)": sum(plain["failed"].values()),
        "answers differing, cached run (0)": cached.get("answers_differing", 0),
        "answers checked, cached run": cached.get("answers_checked", 0),
        "in-process cache bytes (at most 64 MiB)": cached["cache_bytes"],
    }


def _redis(runs: dict[str, Any]) -> dict[str, Any]:
    plain, cached = runs["uncached"], runs["cached"]
    shared, killed = runs["shared"], runs["redis killed"]
    return {
        "answers differing, Redis runs (0)": sum(
            r.get("answers_differing", 0) for r in (shared, killed)
        ),
        "answers checked, Redis runs": sum(r.get("answers_checked", 0) for r in (shared, killed)),
        "hit ratio, three instances minus one, points (within 5)": 100
        * ((shared["hit_ratio"] or 0) - (cached["hit_ratio"] or 0)),
        "Redis killed: failed calls (0)": sum(killed["failed"].values()),
        "Redis killed: database work after, / uncached (at most 1)": killed.get(
            "db_cpu_ms_per_call_after_midway", 0
        )
        / plain["db_cpu_ms_per_call"],
    }
