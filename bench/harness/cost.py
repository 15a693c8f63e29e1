"""The scenarios about what a call costs and how long it really takes.

``cpu``: server CPU per call against a hand-written gevent server, the asyncio peer
and the threaded baseline. ``latency``: an open loop at fixed fractions of the capacity measured in the
same run (no coordinated omission). ``coalescing``: Zipf viewers of twenty
dashboards, with request coalescing on and off. Built on the helpers of
:mod:`bench.harness.scenarios`.
"""

from __future__ import annotations

from typing import Any

from bench.analysis.goals import Goal, failures_goal, info_row, ratio_goal
from bench.harness.runner import panel_names
from bench.harness.scenario import (
    SINGLE_INTERVAL_S,
    Results,
    Scale,
    Scenario,
    _config,
    _cpu_ms_per_reply,
    _per_rep,
    over_slowest_lookup,
    rps_and_cpu_goals,
)
from service.settings.cores import usable_cores

__all__ = ["cpu_per_call", "open_loop_latency", "coalescing"]


# ---- CPU per call --------------------------------------------------------------------------------


def cpu_per_call(scale: Scale) -> Scenario:
    name = "cpu"
    levels = (1, 50)
    servers = ("fanout", "handwritten", "asyncio", "threaded")
    # Brownout off: at 50 connections the loop is saturated, and lighter answers (optional
    # panels not run) would be counted as calls of the same work as the baselines'.
    whole: dict[str, Any] = {"brownout": False}
    configs = [
        config
        for c in levels
        for config in (
            _config(name, "fanout", "stats", c, **whole),
            *(_config(name, s, "stats", c) for s in servers if s != "fanout"),
            # As shipped, the hub monitor is on (every other configuration has it off).
            _config(
                name, "fanout", "stats", c, label="fanout-hub-monitor", hub_monitor=True, **whole
            ),
        )
    ]
    # Each panel asked for alone, as in the efficiency scenario: the yardstick of p50.
    singles = len(panel_names())
    configs.append(
        _config(
            name,
            "fanout",
            "stats_each_panel",
            singles,
            label="single-lookups",
            interval_s=SINGLE_INTERVAL_S,
        )
    )
    # What `server.workers = "auto"` starts here: the threaded server cannot pass one core.
    cores = usable_cores()
    if cores > 1:
        configs.append(
            _config(
                name, "fanout", "stats", 50, label="fanout-workers-auto", workers=cores, **whole
            )
        )

    def goals(results: Results) -> list[Goal]:
        out = [
            over_slowest_lookup(
                name,
                "p50 fanout at 1 connection / slowest lookup alone (p50)",
                results.get(f"{name}/fanout/c1"),
                "p50",
                results.get(f"{name}/single-lookups/c{singles}"),
                limit=1.15,
            )
        ]
        rows = (
            ("fanout / hand-written gevent", "fanout", "handwritten", 0.7),
            (
                "fanout with the hub monitor on (as shipped) / off",
                "fanout-hub-monitor",
                "fanout",
                None,
            ),
            ("fanout / asyncio peer", "fanout", "asyncio", None),
            ("fanout / threaded", "fanout", "threaded", None),
        )
        for c in levels:
            connections = f"{c} connection{'s' if c > 1 else ''}"
            for text, over, under, limit in rows:
                out.append(
                    ratio_goal(
                        name,
                        f"server CPU per call {text}, {connections}",
                        _cpu_ms_per_reply(results.get(f"{name}/{over}/c{c}")),
                        _cpu_ms_per_reply(results.get(f"{name}/{under}/c{c}")),
                        limit=limit,
                        at_most=True,
                    )
                )
        out.append(
            ratio_goal(
                name,
                "calls/s fanout / threaded at 50 connections",
                _per_rep(results.get(f"{name}/fanout/c50"), "rps"),
                _per_rep(results.get(f"{name}/threaded/c50"), "rps"),
                limit=1.5,
                at_most=False,
            )
        )
        if cores > 1:
            out.append(
                ratio_goal(
                    name,
                    f"calls/s fanout with workers = auto ({cores}) / threaded at 50 connections",
                    _per_rep(results.get(f"{name}/fanout-workers-auto/c50"), "rps"),
                    _per_rep(results.get(f"{name}/threaded/c50"), "rps"),
                    limit=1.5,
                    at_most=False,
                )
            )
        out.append(
            ratio_goal(
                name,
                "p50 fanout / hand-written at 1 connection",
                _per_rep(results.get(f"{name}/fanout/c1"), "p50_ms"),
                _per_rep(results.get(f"{name}/handwritten/c1"), "p50_ms"),
                limit=None,
                at_most=True,
            )
        )
        return out

    notes = [
        "Closed loop of get_app_stats (7 lookups, 20 ms backend delay), tracing off. "
        "Slowest lookup = the largest p50 among the 7 panels, each asked for alone "
        f"on its own connection (one call every {SINGLE_INTERVAL_S:g} s each). "
        "CPU per call = the server process's CPU (from /proc, per window) / replies. "
        "Fanout runs with admission on, as shipped, and brownout off, so that each reply "
        "is every panel's work; the CPU of the calls admission refuses counts, their "
        "refusals are no replies. "
        "hand-written = bench/baselines/handwritten.py: a gevent StreamServer, plain "
        "gevent.spawn per lookup, plain pymongo aggregate and requests get, the same "
        "queries and parsing; asyncio peer = bench/baselines/asyncio_peer.py (uvloop, "
        "thriftpy2's asyncio server, AsyncMongoClient, aiohttp); threaded = TThreadedServer "
        "and a ThreadPoolExecutor."
    ]
    return Scenario(name, "CPU per call", configs, goals, notes)


# ---- latency under an open loop ------------------------------------------------------------------

OPEN_LOOP_CONNECTIONS = 50


def open_loop_latency(scale: Scale) -> Scenario:
    name = "latency"
    c = OPEN_LOOP_CONNECTIONS
    probe = _config(name, "fanout", "stats", c, label="capacity")
    configs = [probe] + [
        _config(
            name,
            "fanout",
            "stats",
            c,
            label=f"open-{int(fraction * 100)}",
            open_loop=True,
            capacity_fraction=fraction,
            capacity_of=probe.key,
            honour_retry_after=True,
        )
        for fraction in (0.5, 0.9)
    ]

    def goals(results: Results) -> list[Goal]:
        out = [
            info_row(
                name,
                f"capacity: complete calls/s, closed loop at {c} connections",
                _shown_mean(results.get(probe.key), "rps", "/s"),
            )
        ]
        for fraction in (50, 90):
            result = results.get(f"{name}/open-{fraction}/c{c}")
            pooled = (result or {}).get("pooled") or {}
            shown = (
                f"{pooled['p50_ms']:.1f} / {pooled['p99_ms']:.1f} ms"
                if pooled
                else (result or {}).get("error", "n/a")
            )
            out.append(
                info_row(
                    name,
                    f"open loop at {fraction}% of capacity: p50 / p99",
                    shown,
                    note="latency from each call's scheduled start (wrk2's correction)",
                )
            )
        closed = (results.get(probe.key) or {}).get("pooled") or {}
        if closed:
            out.append(
                info_row(
                    name,
                    "closed loop at capacity: p50 / p99 (coordinated omission)",
                    f"{closed['p50_ms']:.1f} / {closed['p99_ms']:.1f} ms",
                )
            )
        return out

    notes = [
        f"Capacity = complete calls/s of a closed loop at {c} connections (get_app_stats, "
        "7 lookups, 20 ms backends). Then the same connections offer 50% and 90% of it "
        "at a fixed rate, each on its own schedule from a random phase; a call that could "
        "not start on time starts at once and its latency counts from its scheduled "
        "start, as wrk2 measures (latencies are kept whole, not in a histogram)."
    ]
    return Scenario(name, "Latency under a fixed arrival rate (open loop)", configs, goals, notes)


def _shown_mean(result: dict[str, Any] | None, key: str, unit: str) -> str:
    values = _per_rep(result, key)
    return f"{sum(values) / len(values):.1f}{unit}" if values else "n/a"


# ---- request coalescing ------------------------------------------------------------------------

ZIPF_VIEWERS = 200
ZIPF_INTERVAL_S = 1.0


def coalescing(scale: Scale) -> Scenario:
    name = "coalescing"
    configs = [
        _config(
            name,
            "fanout",
            "stats_zipf",
            ZIPF_VIEWERS,
            label=f"coalesce-{mode}",
            coalesce=mode == "on",
            interval_s=ZIPF_INTERVAL_S,
            window_scale=2.0,
            honour_retry_after=True,
        )
        for mode in ("on", "off")
    ]

    def goals(results: Results) -> list[Goal]:
        on = results.get(f"{name}/coalesce-on/c{ZIPF_VIEWERS}")
        off = results.get(f"{name}/coalesce-off/c{ZIPF_VIEWERS}")
        out = rps_and_cpu_goals(
            name,
            (
                "calls/s coalescing on / off (200 viewers, Zipf over 20 dashboards)",
                "server CPU per reply, coalescing on / off",
            ),
            on,
            off,
        )
        for label, result in (("on", on), ("off", off)):
            out.append(
                info_row(
                    name,
                    f"backend calls per call, coalescing {label}",
                    _backend_calls(result),
                    note="lookups run / calls admitted, "
                    "from the server's task counters (warm-up included)",
                )
            )
        # 200 calls/s offered is more than one process serves either way: Overloaded is expected.
        out.append(
            failures_goal(
                name,
                "failed calls with coalescing on (Overloaded aside)",
                on,
                ignore=("overloaded",),
            )
        )
        return out

    notes = [
        f"{ZIPF_VIEWERS} viewers (connections), each calling once every "
        f"{ZIPF_INTERVAL_S:g} s from a random phase and waiting out retry_after_ms after an "
        "Overloaded (200 calls/s offered: more than one process serves either way, so "
        "calls/s is capacity), each watching one of 20 "
        "dashboards with Zipf popularity (s = 1: the top one has 56 viewers, the last 3); "
        "the sample data has three apps, so the dashboards are app shop's day shifted by "
        "k minutes, twenty distinct questions to the server. 7 lookups per call, 20 ms "
        "backend delay. Every other scenario runs with coalescing off: they send one "
        "question on every call, and sharing it would compare unequal work."
    ]
    return Scenario(name, "Request coalescing (Zipf viewers)", configs, goals, notes)


def _backend_calls(result: dict[str, Any] | None) -> str:
    tasks = (result or {}).get("tasks") or {}
    started, coalesced = tasks.get("started", 0), tasks.get("coalesced", 0)
    if not started:
        return "n/a"
    return f"{len(panel_names()) * (started - coalesced) / started:.2f} of {len(panel_names())}"
