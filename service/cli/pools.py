"""``fanout pools``: how full each pool of a live server is, and what size it should be.

One line per pool::

    mongo size=31 in_use_p99=31 wait_p99_ms=128.0 recommended=52 limited_by=slots

``recommended`` is Little's law over the server's rolling window: the mean number
of takers holding or waiting for a slot (attempts per second x (mean wait + mean
hold), takers that waited in vain included) x 1.25 headroom.
For ``fanout.request`` (a pool per call, ``fanout.pool_size``) it is the 99th
percentile of the tasks one call wanted at once. The last line is the adaptive
admission limit, which sizes itself; then the tasks started since start and those that
shared an identical lookup's call (request coalescing); with the results cache on, the
share of buckets read rather than queried, and the memory it holds against its bound
(evictions: ``cache.max_bytes`` is too small for the windows viewers open)::

    cache 99.6% of 48210 buckets read, 11.2 MiB of 64.0 MiB

When the brownout dimmer was
up in the window, a last line says so: then the dimmer bounded the load (calls answered
lighter or refused by criticality), and the pools' use is what was left to them::

    brownout level=0.35 peak=0.60 over 60 s: 5210 calls answered lighter, 1873 refused ...

Then one line per caller label (fair share; the configured callers, the first names seen,
and ``other``), the busiest first: its share of the admission limit now (0 when it has
not called within the last second), its calls in flight, and its calls since start::

    caller reports weight=1 share=40.0 in_flight=12 admitted=5210 refused=0

With pre-forked workers the first block is the group's (sizes, use and arrivals added up;
recommendations added up over the workers with traffic in the window and scaled to them
all, as an idle worker's pool measured nothing), then one block per serving worker, each
line led by ``worker=N``; the last line names the worker that answered.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["format_pools", "pools_to_json"]


def pools_to_json(report: Any) -> dict[str, Any]:
    """A ``PoolReport`` (or one worker's ``WorkerPools``) as plain values."""
    plain = {
        "pools": [{key: getattr(pool, key) for key in pool.__dict__} for pool in report.pools],
        "admission": {
            "limit": report.admission_limit,
            "calls_in_flight": report.calls_in_flight,
            "calls_queued": report.calls_queued,
        },
        "tasks": {"started": report.tasks_started, "coalesced": report.tasks_coalesced},
        "brownout": {
            "level": report.brownout_level,
            "peak": report.brownout_peak,
            "calls_lighter": report.calls_lighter,
            "calls_shed": report.calls_shed,
        },
        "callers": [
            {key: getattr(row, key) for key in row.__dict__} for row in report.callers or []
        ],
        "cache": {
            "hits": report.cache_hits,
            "misses": report.cache_misses,
            "evictions": report.cache_evictions,
            "bytes": report.cache_bytes,
            "max_bytes": report.cache_max_bytes,
        },
    }
    if getattr(report, "workers", None):
        plain["answered_by"] = report.worker
        plain["workers"] = {worker.worker: pools_to_json(worker) for worker in report.workers}
    return plain


def format_pools(report: Any, as_json: bool = False) -> str:
    """One line per pool, then the admission line (or the JSON of :func:`pools_to_json`);
    for a group, the group's block and then each worker's."""
    if as_json:
        return json.dumps(pools_to_json(report), indent=2)
    if not getattr(report, "workers", None):
        return "\n".join(_block(report))
    lines = [f"group of {len(report.workers)} workers", *_block(report)]
    for worker in report.workers:
        lines.extend(f"worker={worker.worker} {line}" for line in _block(worker))
    lines.append(f"(answered by worker {report.worker})")
    return "\n".join(lines)


def _block(report: Any) -> list[str]:
    lines = [
        f"{pool.name} size={pool.size} in_use_p99={pool.in_use_p99} "
        f"wait_p99_ms={pool.wait_p99_ms:.1f} recommended={pool.recommended}" + _short(pool)
        for pool in report.pools
    ]
    lines.append(
        f"admission limit={report.admission_limit} in_flight={report.calls_in_flight} "
        f"queued={report.calls_queued} (adaptive)"
    )
    if report.tasks_started is not None:
        lines.append(
            f"tasks started={report.tasks_started} coalesced={report.tasks_coalesced or 0}"
        )
    if report.cache_max_bytes is not None:
        lines.append(_cache_line(report))
    if report.brownout_peak:
        lines.append(
            f"brownout level={report.brownout_level:.2f} peak={report.brownout_peak:.2f} "
            f"over 60 s: {report.calls_lighter or 0} calls answered lighter, "
            f"{report.calls_shed or 0} refused ({_brownout_bound(report.pools)})"
        )
    lines.extend(
        f"caller {row.caller} weight={row.weight:g} share={row.share:.1f} "
        f"in_flight={row.calls_in_flight} admitted={row.admitted} refused={row.refused}"
        for row in report.callers or []
    )
    return lines


def _brownout_bound(pools: Any) -> str:
    """What bound the calls while the dimmer was up: the dimmer, unless pools were short of
    slots even with it (they keep it up: ``service.overload.brownout``)."""
    short = [pool.name for pool in pools if pool.limited_by == "slots"]
    if not short:
        return "the dimmer was the bound, not the pools"
    return f"the dimmer was up, and {', '.join(short)} short of slots even so"


def _cache_line(report: Any) -> str:
    """The results cache: the share of buckets read rather than queried, and its memory."""
    seen = (report.cache_hits or 0) + (report.cache_misses or 0)
    read = (
        f"{100 * (report.cache_hits or 0) / seen:.1f}% of {seen} buckets read"
        if seen
        else "no bucket asked for yet"
    )
    if not report.cache_max_bytes:
        return f"cache {read} (buckets in Redis)"
    held = (
        f"{(report.cache_bytes or 0) / 2**20:.1f} MiB of {report.cache_max_bytes / 2**20:.1f} MiB"
    )
    advice = (
        f", {report.cache_evictions} evicted: raise cache.max_bytes or share Redis"
        if report.cache_evictions
        else ""
    )
    return f"cache {read}, {held}{advice}"


def _short(pool: Any) -> str:
    """What the advice rests on, when it is not plain Little's law."""
    if pool.limited_by == "cpu":
        return " limited_by=cpu (takers waited on a saturated CPU: more slots would not help)"
    if pool.limited_by == "slots":
        return " limited_by=slots"
    if not pool.offered_per_s:
        return " (idle: nothing measured in the window)"
    return ""
