"""A dashboard many viewers keep open, with the results cache against without, on
FerretDB 2 and on nx-27017.

    python -m gevent.monkey --module bench.dashboard [--viewers 20] [--seconds S]
        [--documents 200000] [--nx-documents 10000] [--engines ferretdb,nx-27017]
        [--bucket-ms 120000] [--settle-ms 30000] [--plan buckets|measured]
                                                              (make bench-dashboard)

Each engine (FerretDB 2 on PostgreSQL with DocumentDB, which ``make compat`` builds; the
nx-27017 server the tests use) is seeded with ``--documents`` requests (``--nx-documents``
on nx-27017), half as many queries and a quarter as many errors, over the last 25 hours
for 10 apps, with the ``(app, ts)`` index. Each viewer watches one app's last 24 hours
(the window slides with the clock) and refreshes the four MongoDB panels every 10 s, for
``--seconds`` per run: by default one ``--bucket-ms`` and its ``--settle-ms`` and a
refresh, so that each run spans a whole bucket cycle, the fill of a bucket that has just settled included. The
runs, each on a fresh ``fanout serve``:

1. ``uncached``: one instance, no cache;
2. ``cached``: one instance, the in-process cache (warmed first: :func:`warm`),
   its windows planned as ``--plan`` says (``cache.plan``, its default
   unless given);
3. ``shared``: three instances sharing a real ``redis-server``, viewers spread over them;
4. ``redis killed``: the same, with Redis killed halfway.

FerretDB 2 runs all four; nx-27017 the first two (the last two are about Redis, not the
engine). For each run: the database's CPU (the engine's processes, from ``/proc``) per
call, raw and less what the engine spent idle over 5 s just before (its own background
work; read once no timing of the measured plan runs), MongoDB operations per call
(``fanout_backend_attempts_total``), the windows the panels' own queries answered
(``fanout_cache_query_windows_total``), the measured plan's timings run meanwhile
(``fanout_cache_timings_total``), Fanout's CPU per call (idle included, and less its
idle), p50 and p99, failed calls, and the buckets' hit ratio. Every answer of a cached
run is then compared with the same call asked ``fresh`` (the data does not change during
the bench, so that is the uncached answer of that moment): counts, keys and order
exactly, sums of durations within 1e-9 relative. Bounded: it stops by itself, and stops
every process it started.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent

from bench.dashboard_goals import dashboard_goals
from bench.dashboard_stack import (
    APPS,
    Instance,
    database_cpu_s,
    one_aggregation_ms,
    seed,
    series_sum,
    settle,
    window_now,
)
from lookups.cache.settings import CacheSettings
from service.client import AppStatsClient
from tests.support.panels import close_panels

PANELS = ["errors", "urls", "controllers", "queries"]
REFRESH_S = 10.0
#: nx-27017 holds its documents in memory and runs one command at a time: at FerretDB's
#: count (or a quarter of it), twenty viewers' uncached panels alone queue past their
#: deadlines there.
NX_DOCUMENTS = 10_000
RESULTS = Path(__file__).resolve().parent / "results" / "dashboard.json"


@dataclass
class Run:
    """What one configuration's viewers saw, and what it cost."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    answers: list[tuple[int, str, int, int, Any]] = field(default_factory=list)
    windows: list[dict[str, float]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def viewer(index: int, instance: Instance, run: Run, until: float, phase_s: float) -> None:
    """One viewer: ``APPS[index % 10]``'s last 24 hours every :data:`REFRESH_S`."""
    app = APPS[index % len(APPS)]
    with AppStatsClient("127.0.0.1", instance.port, timeout_ms=15_000) as client:
        next_at = time.monotonic() + phase_s
        while next_at < until:
            gevent.sleep(max(0.0, next_at - time.monotonic()))
            start_ms, end_ms = window_now()
            began = time.monotonic()
            try:
                response = client.get_app_stats(app, start_ms, end_ms, PANELS, deadline_ms=10_000)
                failed = [o.name for o in response.outcomes if o.status != 0]
                if failed:
                    run.failures["panel"] = run.failures.get("panel", 0) + 1
                else:
                    run.latencies_ms.append((time.monotonic() - began) * 1000)
                    run.answers.append((instance.port, app, start_ms, end_ms, response.panels))
            except Exception as exc:
                kind = type(exc).__name__
                run.failures[kind] = run.failures.get(kind, 0) + 1
            next_at += REFRESH_S


def measure(
    run: Run,
    instances: list[Instance],
    engine_pids: list[int],
    viewers: int,
    seconds: float,
    midway: Any | None = None,
) -> None:
    """Run ``viewers`` for ``seconds`` over ``instances`` (round robin) and fill ``run.figures``;
    ``midway()`` is called halfway, and the second half is measured apart too."""
    _wait_for_timings(instances)
    idle_per_s, fanout_idle_per_s = _idle_per_s(instances, engine_pids)
    # Scrapes cost the instances CPU: they come before the CPU is read, and after it.
    ops0, hits0, misses0, query0, timings0, _ = _counters(instances)
    db0, cpu0 = database_cpu_s(engine_pids), sum(i.cpu_s() for i in instances)
    began = time.monotonic()
    until = time.monotonic() + seconds
    greenlets = [
        gevent.spawn(
            viewer,
            index,
            instances[index % len(instances)],
            run,
            until,
            REFRESH_S * index / viewers,
        )
        for index in range(viewers)
    ]
    half: dict[str, float] = {}
    # Every refresh period a window: the CPU per call of each, for the ratios' intervals.
    mark, count = (db0, cpu0, 0, began), int(seconds // REFRESH_S)
    for index in range(count):
        if midway is not None and index == count // 2:
            midway()
            half = {"db": database_cpu_s(engine_pids), "calls": _calls(run)}
        gevent.sleep(max(0.0, began + (index + 1) * REFRESH_S - time.monotonic()))
        now = (
            database_cpu_s(engine_pids),
            sum(i.cpu_s() for i in instances if i.process.poll() is None),
            _calls(run),
            time.monotonic(),
        )
        spent, done = now[3] - mark[3], max(now[2] - mark[2], 1)
        run.windows.append(
            {
                "db_cpu_ms_per_call": (now[0] - mark[0] - idle_per_s * spent) * 1000 / done,
                "fanout_cpu_ms_per_call": (now[1] - mark[1] - fanout_idle_per_s * spent)
                * 1000
                / done,
            }
        )
        mark = now
    gevent.joinall(greenlets, timeout=seconds + 60)
    calls = len(run.latencies_ms) + sum(run.failures.values())
    db, cpu = (
        database_cpu_s(engine_pids),
        sum(i.cpu_s() for i in instances if i.process.poll() is None),
    )
    elapsed = time.monotonic() - began
    busy = db - db0 - idle_per_s * elapsed
    *after, cache_bytes = _counters(instances)
    ops, hits, misses, query_windows, timings = (
        a - b for a, b in zip(after, (ops0, hits0, misses0, query0, timings0))
    )
    latencies = sorted(run.latencies_ms) or [float("nan")]
    run.figures = {
        "viewers": viewers,
        "seconds": seconds,
        "instances": len(instances),
        "calls": calls,
        "failed": dict(run.failures),
        "db_cpu_s": db - db0,
        "db_idle_cpu_ms_per_s": idle_per_s * 1000,
        "db_cpu_ms_per_call": busy * 1000 / max(calls, 1),
        "db_cpu_ms_per_call_raw": (db - db0) * 1000 / max(calls, 1),
        "mongo_ops_per_call": ops / max(calls, 1),
        "fanout_idle_cpu_ms_per_s": fanout_idle_per_s * 1000,
        "fanout_cpu_ms_per_call": (cpu - cpu0 - fanout_idle_per_s * elapsed) * 1000 / max(calls, 1),
        "fanout_cpu_ms_per_call_with_idle": (cpu - cpu0) * 1000 / max(calls, 1),
        "query_windows": query_windows,
        "timings": timings,
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))],
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "cache_bytes": cache_bytes,
        "windows": run.windows,
        "latencies_ms": run.latencies_ms,
    }
    if half:
        later_calls = calls - half["calls"]
        run.figures["db_cpu_ms_per_call_after_midway"] = (
            (db - half["db"]) * 1000 / max(later_calls, 1)
        )


def _calls(run: Run) -> int:
    return len(run.latencies_ms) + sum(run.failures.values())


def _wait_for_timings(instances: list[Instance], timeout_s: float = 60.0) -> None:
    """Until no instance runs a timing of the measured plan (a minute at most): the engine's
    idle work is read next, and a timing then would count as the engine's own."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        scrapes = [instance.scrape() for instance in instances]
        if not sum(series_sum(s, "fanout_cache_timings_running") for s in scrapes):
            return
        gevent.sleep(0.5)


def _idle_per_s(instances: list[Instance], engine_pids: list[int]) -> tuple[float, float]:
    """CPU seconds a second the engine and the instances spend idle (pg_cron, health
    checks, the hub monitor), over 5 s: subtracted from what the viewers' calls cost."""
    database, fanout = database_cpu_s(engine_pids), sum(i.cpu_s() for i in instances)
    gevent.sleep(5)
    return (
        (database_cpu_s(engine_pids) - database) / 5,
        (sum(i.cpu_s() for i in instances) - fanout) / 5,
    )


def _counters(instances: list[Instance]) -> tuple[float, float, float, float, float, float]:
    """MongoDB operations, buckets read and missed, windows the panels' own queries
    answered, and the measured plan's timings, since the instances started; the most bytes
    one of them holds: one scrape of each."""
    scrapes = [instance.scrape() for instance in instances]
    return (
        sum(
            series_sum(s, "fanout_backend_attempts_total", 'fanout_backend="mongo"')
            for s in scrapes
        ),
        sum(series_sum(s, "fanout_cache_hits_total") for s in scrapes),
        sum(series_sum(s, "fanout_cache_misses_total") for s in scrapes),
        sum(series_sum(s, "fanout_cache_query_windows_total") for s in scrapes),
        sum(series_sum(s, "fanout_cache_timings_total") for s in scrapes),
        max((series_sum(s, "fanout_cache_bytes") for s in scrapes), default=0.0),
    )


def warm(instances: list[Instance]) -> None:
    """One call per app on each instance, twice, the timings the first round started ended
    before the second: the measured plan has chosen (the first call of each panel starts its
    first timing), and the buckets, if chosen, are filled (every bucket of each app's window,
    where the engine groups by bucket), as a warmed cache's are."""
    for _ in range(2):
        for instance in instances:
            with AppStatsClient("127.0.0.1", instance.port, timeout_ms=60_000) as client:
                for app in APPS:
                    client.get_app_stats(app, *window_now(), PANELS, deadline_ms=60_000)
        _wait_for_timings(instances)


def verify(run: Run, instances: list[Instance]) -> dict[str, int]:
    """Every answer of ``run`` against the same call asked ``fresh`` on the same instance."""
    by_port = {i.port: i for i in instances if i.process.poll() is None}
    checked = differing = unverified = 0
    clients = {port: AppStatsClient("127.0.0.1", port, timeout_ms=60_000) for port in by_port}
    try:
        for port, app, start_ms, end_ms, panels in run.answers:
            if port not in clients:
                continue
            fresh = clients[port].get_app_stats(
                app, start_ms, end_ms, PANELS, deadline_ms=60_000, fresh=True
            )
            if not all(name in fresh.panels for name in PANELS):
                unverified += 1  # the fresh call itself lost a panel (a saturated engine)
                continue
            checked += 1
            differing += not all(close_panels(panels[name], fresh.panels[name]) for name in PANELS)
    finally:
        for client in clients.values():
            client.close()
    return {
        "answers_checked": checked,
        "answers_differing": differing,
        "answers_unverified": unverified,
    }


#: Each run's configuration: its name, whether cached, how many instances.
CONFIGURATIONS = (
    ("uncached", False, 1),
    ("cached", True, 1),
    ("shared", True, 3),
    ("redis killed", True, 3),
)
#: The engines, and the configurations each runs (the Redis ones are not the engine's).
ENGINES = {"ferretdb": CONFIGURATIONS, "nx-27017": CONFIGURATIONS[:2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--viewers", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument(
        "--nx-documents",
        type=int,
        default=NX_DOCUMENTS,
        help="nx-27017's seed: it serves one command at a time, so fewer than FerretDB's",
    )
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--bucket-ms", type=int, default=120_000)
    parser.add_argument("--settle-ms", type=int, default=30_000)
    parser.add_argument("--plan", choices=("buckets", "measured"), default=CacheSettings().plan)
    args = parser.parse_args(argv)
    if args.seconds is None:  # a whole bucket cycle and a refresh
        args.seconds = (args.bucket_ms + args.settle_ms) / 1000 + REFRESH_S
    engines = [name for name in args.engines.split(",") if name]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    from tests.support.toolchains import missing

    needed = missing("redis") + (missing("compat") if "ferretdb" in engines else [])
    if needed:
        print(f"dashboard: skipped: needs FerretDB 2 (make compat) and redis-server ({needed})")
        return 0
    results: dict[str, Any] = {
        "viewers": args.viewers,
        "seconds": args.seconds,
        "documents": args.documents,
        "nx-27017 documents": args.nx_documents,
        "cache.bucket_ms": args.bucket_ms,
        "cache.settle_ms": args.settle_ms,
        "cache.plan": args.plan,
    }
    with tempfile.TemporaryDirectory(prefix="fanout-dashboard-") as work:
        for name in engines:
            results[name] = engine_runs(name, Path(work), args)
    results["goals"] = dashboard_goals(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["goals"], indent=2))
    return 0


def engine_runs(name: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration of engine ``name``, seeded afresh, with its figures."""
    from service.samples import MongoWireServer
    from tests.support.ferretdb import FerretDbServer

    figures: dict[str, Any] = {}
    with FerretDbServer() if name == "ferretdb" else MongoWireServer() as engine:
        began = time.monotonic()
        documents = args.documents if name == "ferretdb" else args.nx_documents
        seed(engine.uri, documents, int(time.time() * 1000))
        figures["seed_s"] = round(time.monotonic() - began, 1)
        figures["one_uncached_aggregation_ms"] = round(one_aggregation_ms(engine.uri), 1)
        figures["settle_s"] = settle(engine.pids())
        print(
            f"dashboard: {name}: seeded in {figures['seed_s']} s; one uncached aggregation "
            f"{figures['one_uncached_aggregation_ms']} ms",
            flush=True,
        )
        for config, cached, count in ENGINES[name]:
            figures[config] = configuration(config, cached, count, engine, workdir, args)
            print(f"dashboard: {name}: {config}: {json.dumps(figures[config])}", flush=True)
    return figures


def configuration(
    name: str, cached: bool, count: int, engine: Any, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One configuration's figures: ``count`` instances (sharing a Redis when more than one),
    warmed when ``cached``, every cached answer checked afterwards."""
    from tests.support.redis_server import RedisServer

    redis = RedisServer() if count > 1 else None
    cache = {
        "enabled": cached,
        "bucket_ms": args.bucket_ms,
        "settle_ms": args.settle_ms,
        "plan": args.plan,
        **({"url": redis.url} if redis else {}),
    }
    instances = [Instance(engine.uri, cache, workdir) for _ in range(count)]
    try:
        if cached:
            warm(instances)
        run = Run(name)
        measure(
            run,
            instances,
            engine.pids(),
            args.viewers,
            args.seconds,
            midway=redis.kill if name == "redis killed" and redis else None,
        )
        if cached:
            run.figures.update(verify(run, instances))
        return run.figures
    finally:
        for instance in instances:
            instance.stop()
        if redis is not None:
            redis.stop()


if __name__ == "__main__":
    sys.exit(main())
