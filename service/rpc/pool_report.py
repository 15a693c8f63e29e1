"""The answer of ``pool_stats()``: one server's pools, or a pre-forked group's.

A server's report is its pools' meters over the rolling window and its admission
state, read from one :class:`~service.operations.snapshot.ServiceSnapshot`
(:func:`own_report`, as plain values, which the workers of a group also send
their master). In a group the worker that answers gives every serving worker's
report, labelled by worker, and above them the group's: sizes, use, arrivals,
timeouts added up, recommendations added up over the workers that had traffic and scaled
to them all, waits and percentiles the largest, the mean hold weighted by arrivals
(:func:`group_report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from service.idl import appstats
from service.operations.snapshot import ServiceSnapshot

__all__ = ["own_report", "to_thrift", "group_report"]

_SUMMED = ("size", "in_use", "in_use_p99", "offered_per_s", "timeouts", "recommended")
_LARGEST = ("wait_p99_ms", "window_s")
_COUNTS = (
    "admission_limit",
    "calls_in_flight",
    "calls_queued",
    "tasks_started",
    "tasks_coalesced",
    "calls_lighter",
    "calls_shed",
)
_CACHE = ("cache_hits", "cache_misses", "cache_evictions", "cache_bytes", "cache_max_bytes")
_LEVELS = ("brownout_level", "brownout_peak")  # a group's: its highest worker's


def own_report(snapshot: ServiceSnapshot) -> dict[str, Any]:
    """This server's pools and admission state, as plain values."""
    return {
        "pools": [dataclasses.asdict(pool) for pool in snapshot.pools],
        "brownout_level": snapshot.brownout_level,
        "brownout_peak": snapshot.brownout_peak,
        "calls_lighter": snapshot.calls_lighter,
        "calls_shed": snapshot.calls_shed,
        "admission_limit": snapshot.admission_limit,
        "calls_in_flight": snapshot.calls_in_flight,
        "calls_queued": snapshot.calls_queued,
        "tasks_started": snapshot.tasks.started,
        "tasks_coalesced": snapshot.tasks_coalesced,
        "callers": _callers(snapshot),
        **_cache(snapshot),
    }


def _callers(snapshot: ServiceSnapshot) -> list[dict[str, Any]]:
    """Each caller label's weight, share of the limit now, and use, the busiest first."""
    rows = [
        {
            "caller": label,
            "weight": snapshot.caller_weights.get(label, 1.0),
            "share": round(snapshot.caller_shares.get(label, 0.0), 2),
            "calls_in_flight": counts.inflight,
            "admitted": counts.admitted,
            "refused": counts.refused,
        }
        for label, counts in snapshot.callers.items()
    ]
    return sorted(rows, key=_busiest)


def _busiest(row: dict[str, Any]) -> tuple[int, int]:
    return -row["calls_in_flight"], -(row["admitted"] + row["refused"])


def _cache(snapshot: ServiceSnapshot) -> dict[str, Any]:
    """The results cache's counters, none when it is off; its bound 0 where buckets are in Redis."""
    if snapshot.cache is None:
        return {}
    return {
        "cache_hits": snapshot.cache.hits,
        "cache_misses": snapshot.cache.misses,
        "cache_evictions": snapshot.cache.evictions,
        "cache_bytes": snapshot.cache.bytes,
        "cache_max_bytes": snapshot.cache_max_bytes,
    }


def to_thrift(report: dict[str, Any], struct: Any = None, **extra: Any) -> Any:
    """A :func:`own_report` as the IDL's ``PoolReport`` (or ``struct``: ``WorkerPools``)."""
    return (struct or appstats.PoolReport)(
        pools=[appstats.PoolStats(**pool) for pool in report["pools"]],
        callers=[appstats.CallerShareStats(**row) for row in report.get("callers") or []],
        **{key: report.get(key) for key in (*_COUNTS, *_LEVELS, *_CACHE)},
        **extra,
    )


def group_report(answering: str, reports: dict[str, dict[str, Any]]) -> Any:
    """The group's ``PoolReport``: totals above each worker's own, ``answering`` the worker
    that answered. ``reports`` is each serving worker's :func:`own_report`, by worker (its
    position)."""
    workers = sorted(reports, key=int)
    total = {key: sum(reports[worker].get(key) or 0 for worker in workers) for key in _COUNTS}
    total.update(
        {key: max(reports[worker].get(key) or 0.0 for worker in workers) for key in _LEVELS}
    )
    if any("cache_hits" in reports[worker] for worker in workers):
        total.update(
            {key: sum(reports[worker].get(key) or 0 for worker in workers) for key in _CACHE}
        )
    merged = [
        _merged(
            name,
            [
                pool
                for worker in workers
                for pool in reports[worker]["pools"]
                if pool["name"] == name
            ],
        )
        for name in _names(reports[worker]["pools"] for worker in workers)
    ]
    return to_thrift(
        {
            "pools": merged,
            "callers": _group_callers(reports[w].get("callers") for w in workers),
            **total,
        },
        worker=answering,
        workers=[
            to_thrift(reports[worker], appstats.WorkerPools, worker=worker) for worker in workers
        ],
    )


def _names(pool_lists: Iterable[list[dict[str, Any]]]) -> list[str]:
    names: list[str] = []
    for pools in pool_lists:
        names.extend(pool["name"] for pool in pools if pool["name"] not in names)
    return names


def _merged(name: str, pools: list[dict[str, Any]]) -> dict[str, Any]:
    offered = sum(pool["offered_per_s"] for pool in pools)
    merged = {key: sum(pool[key] for pool in pools) for key in _SUMMED}
    merged.update({key: max(pool[key] for pool in pools) for key in _LARGEST})
    merged["offered_per_s"] = round(offered, 3)
    merged["hold_ms"] = (
        round(sum(pool["hold_ms"] * pool["offered_per_s"] for pool in pools) / offered, 3)
        if offered
        else 0.0
    )
    merged["recommended"] = _group_recommended(pools)
    merged["limited_by"] = next(
        (pool["limited_by"] for pool in pools if pool.get("limited_by")), ""
    )
    return {"name": name, **merged}


def _group_recommended(pools: list[dict[str, Any]]) -> int:
    """The group's size for a pool, from the workers whose pool was asked for anything in
    the window, scaled to every worker: an idle worker's pool measured nothing, and counting
    its size as its recommendation would read as advice (the spread of connections gives
    it the others' share of the load). Every worker idle: the sizes, nothing to change."""
    measured: list[int] = [pool["recommended"] for pool in pools if pool["offered_per_s"] > 0]
    if not measured:
        return sum(pool["recommended"] for pool in pools)
    return math.ceil(sum(measured) * len(pools) / len(measured))


def _group_callers(rows_by_worker: Iterable[list[dict[str, Any]] | None]) -> list[dict[str, Any]]:
    """Each caller's rows over the workers, added up (each worker shares its own limit)."""
    group: dict[str, dict[str, Any]] = {}
    for rows in rows_by_worker:
        for row in rows or []:
            into = group.get(row["caller"])
            if into is None:
                group[row["caller"]] = dict(row)
                continue
            into["share"] = round(into["share"] + row["share"], 2)
            into["calls_in_flight"] += row["calls_in_flight"]
            into["admitted"] += row["admitted"]
            into["refused"] += row["refused"]
    return sorted(group.values(), key=_busiest)
