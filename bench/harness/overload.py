"""The overload scenario: goodput at 1x, 4x and 20x capacity, in two regimes.

* ``cpu``: backends answer in 20 ms; a call costs the server a few ms of CPU, so one
  core bounds throughput (about 50 closed-loop connections fill it).
* ``pool``: backends answer in 200 ms and the MongoDB and HTTP pools hold 64
  connections, so the pools bound throughput (Little's law: 63 / 0.2 s / 4 Mongo
  operations a call, about 80 calls/s).

Callers are closed-loop and honour ``retry_after_ms`` (jittered), as
``AppStatsClient`` does; a caller refused keeps its connection open. Fanout is
also run with callers that ignore it and try again 50 ms after an ``Overloaded``,
at 50 and at the top level, in both regimes. Goodput is
complete replies per second: every essential panel OK (the four that are not optional;
under overload the brownout dimmer answers without the optional three, see
``bench/harness/brownout.py``). One more configuration pins
admission to a single call in flight and lets 50 callers hammer without backing
off: nearly every answer is then ``Overloaded``, and the server's CPU per answer is
the cost of one refusal, compared with the CPU of one admitted call in the ``cpu``
regime at 50 connections.
"""

from __future__ import annotations

import math
from typing import Any

from bench.analysis.goals import Goal, failures_goal, info_row, monitor_goal, ratio_goal
from bench.analysis.stats import mean_or_nan
from bench.harness.runner import Config
from bench.harness.scenario import Results, Scale, Scenario, _config, _per_rep

__all__ = ["overload", "REGIMES"]

NAME = "overload"
#: regime -> (backend delay ms, pool size)
REGIMES = {"cpu": (20, 200), "pool": (200, 64)}
BASE = 50
WARMUP_S = 5.0
IMPOLITE = "ignoring"
#: How long a caller that ignores retry_after_ms waits after an Overloaded.
IMPOLITE_PAUSE_S = 0.05
#: The floor: the same callers against a server that only holds and refuses.
FLOOR = f"refusing-floor-{IMPOLITE}"


def _key(server: str, regime: str, connections: int, callers: str = "") -> str:
    return f"{NAME}/{server}-{regime}{'-' + callers if callers else ''}/c{connections}"


def _configs(scale: Scale) -> tuple[list[Config], tuple[int, ...], tuple[str, ...]]:
    levels = scale.levels((BASE, 4 * BASE, 20 * BASE), (BASE, 20 * BASE))
    servers = ("fanout", "threaded")
    configs = [
        _config(
            NAME,
            server,
            "stats_essential",
            c,
            label=f"{server}-{regime}",
            delay_ms=delay,
            pool_size=pool,
            honour_retry_after=True,
            warmup_s=WARMUP_S,
            window_scale=2.0,
        )
        for regime, (delay, pool) in REGIMES.items()
        for server in servers
        for c in levels
    ]
    # Callers that ignore retry_after_ms: a retry loop in a web tier, or users pressing reload.
    configs += [
        _config(
            NAME,
            "fanout",
            "stats_essential",
            c,
            label=f"fanout-{regime}-{IMPOLITE}",
            delay_ms=delay,
            pool_size=pool,
            overloaded_pause_s=IMPOLITE_PAUSE_S,
            warmup_s=WARMUP_S,
            window_scale=2.0,
        )
        for regime, (delay, pool) in REGIMES.items()
        for c in (BASE, levels[-1])
    ]
    configs.append(
        _config(
            NAME,
            "fanout",
            "stats_essential",
            BASE,
            label="fanout-refusals",
            delay_ms=200,
            admission="one",
            window_scale=2.0,
        )
    )
    configs.append(
        _config(
            NAME,
            "fanout",
            "stats_essential",
            levels[-1],
            label=f"fanout-refusals-{IMPOLITE}",
            delay_ms=200,
            admission="one-held",
            overloaded_pause_s=IMPOLITE_PAUSE_S,
            warmup_s=WARMUP_S,
            window_scale=2.0,
        )
    )
    # The floor: a gevent server that only holds and refuses, as pacing does (bench.baselines.refusing).
    configs.append(
        _config(
            NAME,
            "refusing",
            "stats_essential",
            levels[-1],
            label=FLOOR,
            delay_ms=200,
            overloaded_pause_s=IMPOLITE_PAUSE_S,
            warmup_s=WARMUP_S,
            window_scale=2.0,
        )
    )
    return configs, levels, servers


def _answers_per_rep(result: dict[str, Any] | None, kinds: tuple[str, ...]) -> list[float]:
    """Answers of ``kinds`` per second, per repetition ("ok", "degraded" or a failure kind)."""
    if not result or "reps" not in result:
        return []
    window_s = result["window_s"]
    return [
        sum(rep.get(k, 0) if k in ("ok", "degraded") else rep["failures"].get(k, 0) for k in kinds)
        / window_s
        for rep in result["reps"]
    ]


def _cpu_per_answer_ms(result: dict[str, Any] | None, kinds: tuple[str, ...]) -> list[float]:
    """Server CPU milliseconds per answer of ``kinds``, per repetition."""
    if not result or "reps" not in result:
        return []
    rates = _answers_per_rep(result, kinds)
    return [
        10.0 * rep["cpu_pct"].get("server", math.nan) / rate  # (pct / 100) * 1000 ms
        for rep, rate in zip(result["reps"], rates)
        if rate > 0
    ]


def _answer_mix(result: dict[str, Any] | None) -> str:
    if not result or "reps" not in result:
        return "n/a"
    ok = sum(r["ok"] for r in result["reps"])
    degraded = sum(r["degraded"] for r in result["reps"])
    failures: dict[str, int] = {}
    for rep in result["reps"]:
        for kind, n in rep["failures"].items():
            failures[kind] = failures.get(kind, 0) + n
    rest = ", ".join(f"{kind} {n}" for kind, n in sorted(failures.items()))
    p99 = (result.get("pooled") or {}).get("p99_ms", math.nan)
    return f"ok {ok}, degraded {degraded}" + (f", {rest}" if rest else "") + f"; p99 {p99:.0f} ms"


def _goals(levels: tuple[int, ...], servers: tuple[str, ...]) -> Any:
    def goals(results: Results) -> list[Goal]:
        out: list[Goal] = []
        top = levels[-1]
        for regime in REGIMES:
            for server in servers:
                out.append(
                    ratio_goal(
                        NAME,
                        f"{server} goodput at {top} / at {BASE} connections ({regime}-bound)",
                        _per_rep(results.get(_key(server, regime, top)), "rps"),
                        _per_rep(results.get(_key(server, regime, BASE)), "rps"),
                        limit=0.9 if server == "fanout" else None,
                        at_most=False,
                    )
                )
            out.append(
                failures_goal(
                    NAME,
                    f"fanout late or failed answers besides Overloaded, {top} conns ({regime})",
                    results.get(_key("fanout", regime, top)),
                    ignore=("overloaded",),
                )
            )
            for server in servers:
                for c in levels:
                    out.append(
                        info_row(
                            NAME,
                            f"answers {server} {regime} c{c}",
                            _answer_mix(results.get(_key(server, regime, c))),
                        )
                    )
        refusal_ms = _cpu_per_answer_ms(
            results.get(f"{NAME}/fanout-refusals/c{BASE}"), ("overloaded",)
        )
        out.append(
            ratio_goal(
                NAME,
                "server CPU of one Overloaded / of one admitted call",
                refusal_ms,
                _cpu_per_answer_ms(results.get(_key("fanout", "cpu", BASE)), ("ok", "degraded")),
                limit=0.05,
                at_most=True,
            )
        )
        admitted_ms = mean_or_nan(
            _cpu_per_answer_ms(results.get(_key("fanout", "cpu", BASE)), ("ok", "degraded"))
        )
        held_ms = _refusal_cpu_ms(
            results.get(f"{NAME}/fanout-refusals-{IMPOLITE}/c{top}"), admitted_ms
        )
        floor_ms = _refusal_cpu_ms(results.get(f"{NAME}/{FLOOR}/c{top}"), 0.0)
        out.append(
            info_row(
                NAME,
                f"server CPU of one Overloaded to callers ignoring "
                f"retry_after_ms, {top} conns (ms)",
                f"{held_ms:.3f}; the floor, a gevent server that only holds and "
                f"refuses: {floor_ms:.3f} (fanout / floor "
                f"{held_ms / floor_ms if floor_ms else math.nan:.2f}x); "
                f"read in full and answered at once: {mean_or_nan(refusal_ms):.3f}",
            )
        )
        out += _impolite_goals(results, top, held_ms, floor_ms)
        out.append(monitor_goal(NAME, results))
        return out

    return goals


def _refusal_cpu_ms(result: dict[str, Any] | None, admitted_ms: float) -> float:
    """Server CPU ms per Overloaded over the whole run, less what the few admitted calls cost.

    Pooled (all the refusing CPU over all the refusals), not a mean of per-repetition
    ratios: callers held together come back together, so a 1 s window holds anything
    from a dozen refusals to a thousand, and the windows with few would weigh as much
    as the others (that mean read 0.165 ms where the pooled figure was 0.105 ms).
    """
    if not result or "reps" not in result:
        return math.nan
    window_s = result["window_s"]
    refused = busy_ms = 0.0
    for rep in result["reps"]:
        answered = (rep["ok"] + rep["degraded"]) / window_s
        refused += rep["failures"].get("overloaded", 0) / window_s
        busy_ms += max(0.0, 10.0 * rep["cpu_pct"].get("server", math.nan) - answered * admitted_ms)
    return busy_ms / refused if refused > 0 else math.nan


def _impolite_goals(results: Results, top: int, refusal_ms: float, floor_ms: float) -> list[Goal]:
    """Callers that ignore retry_after_ms: goodput held, nothing late, refusing stays cheap."""
    out: list[Goal] = []
    for regime in REGIMES:
        high = results.get(_key("fanout", regime, top, IMPOLITE))
        out.append(
            ratio_goal(
                NAME,
                f"fanout goodput at {top} / at {BASE} connections ignoring retry_after_ms "
                f"({regime}-bound)",
                _per_rep(high, "rps"),
                _per_rep(results.get(_key("fanout", regime, BASE, IMPOLITE)), "rps"),
                limit=0.9,
                at_most=False,
            )
        )
        out.append(
            failures_goal(
                NAME,
                f"fanout late or failed answers besides Overloaded, {top} conns ignoring "
                f"retry_after_ms ({regime})",
                high,
                ignore=("overloaded",),
            )
        )
        out.append(
            ratio_goal(
                NAME,
                f"share of the server's CPU spent refusing, {top} conns ignoring "
                f"retry_after_ms ({regime})",
                _refusing_ms_per_s(high, refusal_ms),
                _busy_ms_per_s(high),
                limit=0.05,
                at_most=True,
                note=f"refusals/s x the CPU of one refusal to such callers (fanout-refusals-{IMPOLITE})",
            )
        )
        out.append(
            ratio_goal(
                NAME,
                f"the least share any gevent server would spend refusing, {top} conns ignoring "
                f"retry_after_ms ({regime})",
                _refusing_ms_per_s(high, floor_ms),
                _busy_ms_per_s(high),
                limit=None,
                at_most=True,
                note=f"the same refusals/s x the floor's CPU per refusal ({FLOOR})",
            )
        )
        for c in (BASE, top):
            out.append(
                info_row(
                    NAME,
                    f"answers fanout {regime} c{c} ignoring retry_after_ms",
                    _answer_mix(results.get(_key("fanout", regime, c, IMPOLITE))),
                )
            )
    return out


def _refusing_ms_per_s(result: dict[str, Any] | None, refusal_ms: float) -> list[float]:
    """Per repetition: Overloaded answers per second x the CPU ms of one refusal."""
    if math.isnan(refusal_ms):
        return []
    return [rate * refusal_ms for rate in _answers_per_rep(result, ("overloaded",))]


def _busy_ms_per_s(result: dict[str, Any] | None) -> list[float]:
    """Per repetition: the server's CPU milliseconds per second."""
    if not result or "reps" not in result:
        return []
    return [10.0 * rep["cpu_pct"].get("server", math.nan) for rep in result["reps"]]


def overload(scale: Scale) -> Scenario:
    configs, levels, servers = _configs(scale)
    notes = [
        f"Closed loop at {', '.join(map(str, levels))} connections ({BASE} is about "
        "capacity), meta.deadline_ms 2000; callers wait retry_after_ms x U(0.5, 1.5) after "
        f"an Overloaded. {WARMUP_S:g} s warm-up lets the admission limit settle.",
        "cpu: 20 ms backends, pools of 200; pool: 200 ms backends, MongoDB and HTTP pools "
        "of 64. refusals: admission pinned to one call, refusals not held, 50 callers not "
        "backing off: the server CPU per Overloaded answer.",
        f"ignoring retry_after_ms: callers wait a fixed {IMPOLITE_PAUSE_S * 1000:g} ms after "
        "an Overloaded, whatever it asked for (a retry loop in a web tier). "
        f"refusals-{IMPOLITE}: admission pinned to one call, 1000 such callers: the CPU of "
        "one refusal as they get it (held, mostly unread), less the admitted calls' CPU. "
        f"{FLOOR}: the same callers against bench.baselines.refusing, a gevent server that "
        "only holds each call as pacing does and answers a pre-encoded Overloaded: the "
        "floor of a refusal's CPU.",
    ]
    return Scenario(NAME, "Overload", configs, _goals(levels, servers), notes)
