"""The scenarios of the benchmark: their configurations, and the goals they must show.

Each scenario function returns a :class:`Scenario`: the configurations it runs
(every one on a fresh stack) and a function computing its goals from the results.
Ratios compare configurations of the same run, so the noise of a shared machine
hits both sides; each ratio carries a bootstrap 95% interval over repetitions.
"""

from __future__ import annotations

from bench.analysis.goals import Goal, failures_goal, info_row, ratio_goal
from bench.harness.brownout import brownout
from bench.harness.cost import coalescing, cpu_per_call, open_loop_latency
from bench.harness.fair_share import fair_share
from bench.harness.merged import merged_commands
from bench.harness.overload import overload
from bench.harness.peer import asyncio_peer
from bench.harness.pythons import python_versions
from bench.harness.runner import panel_names
from bench.harness.scenario import (
    SATURATING_CONNECTIONS,
    SERVERS,
    SINGLE_INTERVAL_S,
    Results,
    Scale,
    Scenario,
    _config,
    _per_rep,
    over_slowest_lookup,
)
from bench.harness.steady import steady_storm
from bench.harness.trace_storm import trace_storm
from bench.harness.tracing_cost import tracing_cost

__all__ = ["Scenario", "Scale", "all_scenarios", "SCENARIO_NAMES"]

# ---- fan-out efficiency -------------------------------------------------------------------------

EFFICIENCY_CALLERS = 200
EFFICIENCY_INTERVAL_S = 5.0


def fanout_efficiency(scale: Scale) -> Scenario:
    name = "efficiency"
    servers = ("fanout",) if scale.quick else SERVERS
    configs = [
        _config(
            name,
            s,
            "stats",
            EFFICIENCY_CALLERS,
            interval_s=EFFICIENCY_INTERVAL_S,
            decode_every=10,
            window_scale=2.0,
        )
        for s in servers
    ]
    configs.append(
        _config(
            name,
            "fanout",
            "stats_each_panel",
            len(panel_names()),
            label="single-lookups",
            interval_s=SINGLE_INTERVAL_S,
            window_scale=2.0,
        )
    )

    def goals(results: Results) -> list[Goal]:
        single = results.get(f"{name}/single-lookups/c{len(panel_names())}")
        out = []
        for server in servers:
            calls = results.get(f"{name}/{server}/c{EFFICIENCY_CALLERS}")
            for pct, limit in (("p50", 1.10), ("p99", 1.25)):
                out.append(
                    over_slowest_lookup(
                        name,
                        f"{server} request {pct} / slowest lookup alone (p50)",
                        calls,
                        pct,
                        single,
                        limit=limit if server == "fanout" else None,
                    )
                )
        return out

    notes = [
        f"{EFFICIENCY_CALLERS} callers, each calling get_app_stats (7 lookups, 20 ms "
        f"backend delay) once every {EFFICIENCY_INTERVAL_S:g} s from a random phase "
        f"({EFFICIENCY_CALLERS / EFFICIENCY_INTERVAL_S:.0f} calls/s offered).",
        "Slowest lookup = the largest p50 among the 7 panels, each asked for alone on "
        f"its own connection (7 connections, one call every {SINGLE_INTERVAL_S:g} s "
        "each) against the same backends; "
        "the 20 ms delay is its lower bound. The server's own per-panel times "
        "(sampled replies) are in results.json (server_side).",
    ]
    return Scenario(name, "Fan-out efficiency", configs, goals, notes)


# ---- concurrency --------------------------------------------------------------------------------


def concurrency(scale: Scale) -> Scenario:
    name = "concurrency"
    levels = scale.levels((10, 100, 1000), (1000,))
    configs = [_config(name, s, "stats", c) for c in levels for s in SERVERS]

    def goals(results: Results) -> list[Goal]:
        out = []
        for c in levels:
            fan = results.get(f"{name}/fanout/c{c}")
            for other in ("threaded", "sequential"):
                theirs = results.get(f"{name}/{other}/c{c}")
                out.append(
                    ratio_goal(
                        name,
                        f"RPS fanout / {other} at {c} connections",
                        _per_rep(fan, "rps"),
                        _per_rep(theirs, "rps"),
                        limit=3.0 if (c == 1000 and other == "threaded") else None,
                        at_most=False,
                    )
                )
                if c == 1000 and other == "threaded":
                    out.append(
                        ratio_goal(
                            name,
                            f"all replies/s (degraded included) fanout / {other} at {c}",
                            _per_rep(fan, "replies_per_s"),
                            _per_rep(theirs, "replies_per_s"),
                            limit=None,
                            at_most=False,
                        )
                    )
        out.append(
            failures_goal(
                name, "fanout failed calls at 1000 connections", results.get(f"{name}/fanout/c1000")
            )
        )
        return out

    notes = [
        "Closed loop: every connection calls get_app_stats (7 lookups, 20 ms backend "
        "delay, meta.deadline_ms 2000) again as soon as the reply arrives. RPS counts "
        "complete replies (all 7 panels OK); degraded replies (some panel TIMEOUT/ERROR) "
        "are counted apart; a reply later than 2.25 s (deadline + client margin) is a "
        "failed call (timeout), as the web tier would have given up."
    ]
    return Scenario(name, "Concurrency", configs, goals, notes)


# ---- 10,000 connections -------------------------------------------------------------------------

C10K = 10_000
C10K_INTERVAL_S = 5.0


def ten_thousand(scale: Scale) -> Scenario:
    name = "c10k"
    configs = [_config(name, "fanout", "ping", C10K, interval_s=C10K_INTERVAL_S, window_scale=2.0)]

    def goals(results: Results) -> list[Goal]:
        result = results.get(f"{name}/fanout/c{C10K}")
        out = [failures_goal(name, f"fanout failed calls, {C10K} connections", result)]
        rss = (result or {}).get("rss_kib", {})
        server = {phase: v.get("server") for phase, v in rss.items()}
        if server.get("before_connect") and server.get("connected"):
            per_conn = (server["connected"] - server["before_connect"]) / C10K
            mib = {phase: (kib or 0) / 1024 for phase, kib in server.items()}
            out.append(
                info_row(
                    name,
                    f"server RSS: {mib['before_connect']:.0f} MiB before, "
                    f"{mib['connected']:.0f} MiB with {C10K} idle connections, "
                    f"{mib.get('end_of_load', 0):.0f} MiB at the end of the load",
                    f"{per_conn:.1f} KiB/conn",
                    note="(connected - before) / connections",
                )
            )
        return out

    notes = [
        f"{C10K} connections opened first (at most 200 connecting at once per load "
        f"process, 4 processes), then each calls ping() once every {C10K_INTERVAL_S:g} s "
        f"from a random phase ({C10K / C10K_INTERVAL_S:.0f} calls/s offered); all stay "
        "open. ping keeps this scenario about holding connections, not about backend "
        "throughput (the concurrency scenario covers that)."
    ]
    return Scenario(name, "10,000 connections", configs, goals, notes)


# ---- raw RPC ------------------------------------------------------------------------------------


def raw_rpc(scale: Scale) -> Scenario:
    name = "raw"
    levels = scale.levels((1, 50, 500), (500,))
    servers = ("fanout", "bare", "threaded")
    configs = [_config(name, s, "ping", c) for c in levels for s in servers]

    def goals(results: Results) -> list[Goal]:
        out = []
        for c in levels:
            fan = _per_rep(results.get(f"{name}/fanout/c{c}"), "rps")
            out.append(
                ratio_goal(
                    name,
                    f"ping RPS fanout / bare at {c} connections",
                    fan,
                    _per_rep(results.get(f"{name}/bare/c{c}"), "rps"),
                    limit=0.9,
                    at_most=False,
                )
            )
            out.append(
                ratio_goal(
                    name,
                    f"ping RPS fanout / threaded at {c} connections",
                    fan,
                    _per_rep(results.get(f"{name}/threaded/c{c}"), "rps"),
                    limit=3.0 if c == 500 else None,
                    at_most=False,
                )
            )
        return out

    notes = [
        "Closed loop of ping() calls; bare = a gevent StreamServer running the "
        "thriftpy2 processor loop with none of Fanout's limits."
    ]
    return Scenario(name, "Raw RPC (ping)", configs, goals, notes)


# ---- multi-core ---------------------------------------------------------------------------------


def multi_core(scale: Scale) -> Scenario:
    name = "workers"
    c = SATURATING_CONNECTIONS
    configs = [
        _config(name, "fanout", "stats", c, label=f"workers-{w}", workers=w, delay_ms=0)
        for w in (1, 2)
    ]

    def goals(results: Results) -> list[Goal]:
        return [
            ratio_goal(
                name,
                "RPS 2 workers / 1 worker (CPU-bound)",
                _per_rep(results.get(f"{name}/workers-2/c{c}"), "rps"),
                _per_rep(results.get(f"{name}/workers-1/c{c}"), "rps"),
                limit=1.7,
                at_most=False,
            )
        ]

    notes = [
        f"CPU-bound: get_app_stats with no backend delay, closed loop at {c} connections. "
        "The load generator and the backends share the same 2 cores with the workers."
    ]
    return Scenario(name, "Multi-core (server.workers)", configs, goals, notes)


# ---- real queries on nx-27017 -------------------------------------------------------------------


def real_queries(scale: Scale) -> Scenario:
    name = "nx"
    servers = ("fanout",) if scale.quick else SERVERS
    configs = [_config(name, s, "stats", 10, mongo="nx", delay_ms=0) for s in servers]

    def goals(results: Results) -> list[Goal]:
        fan = results.get(f"{name}/fanout/c10")
        pooled = (fan or {}).get("pooled")
        out = [
            info_row(
                name,
                "fanout latency with real queries (pooled p50 / p99)",
                f"{pooled['p50_ms']:.1f} / {pooled['p99_ms']:.1f} ms" if pooled else "n/a",
                note="reported as such: nx-27017, not the responder",
            )
        ]
        for other in servers[1:]:
            out.append(
                ratio_goal(
                    name,
                    f"p50 latency fanout / {other} (real queries)",
                    _per_rep(fan, "p50_ms"),
                    _per_rep(results.get(f"{name}/{other}/c10"), "p50_ms"),
                    limit=None,
                    at_most=True,
                )
            )
        return out

    notes = [
        "MongoDB backend = nx-27017 (a real MongoDB-wire server, SQLite in memory) "
        "running the real aggregations; no added delay; 10 connections, closed loop."
    ]
    return Scenario(name, "Real queries (nx-27017)", configs, goals, notes)


SCENARIO_BUILDERS = {
    "efficiency": fanout_efficiency,
    "concurrency": concurrency,
    "overload": overload,
    "c10k": ten_thousand,
    "raw": raw_rpc,
    "tracing": tracing_cost,
    "workers": multi_core,
    "nx": real_queries,
    "coalescing": coalescing,
    "cpu": cpu_per_call,
    "latency": open_loop_latency,
    "python": python_versions,
    "brownout": brownout,
    "fair": fair_share,
    "steady": steady_storm,
    "merge": merged_commands,
    "peer": asyncio_peer,
    "trace-storm": trace_storm,
}
SCENARIO_NAMES = (*tuple(SCENARIO_BUILDERS), "micro")


def all_scenarios(scale: Scale, only: set[str] | None = None) -> list[Scenario]:
    """The scenarios to run, in order (the micro-benchmarks run separately)."""
    return [
        build(scale) for name, build in SCENARIO_BUILDERS.items() if only is None or name in only
    ]
