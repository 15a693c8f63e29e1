"""Run one benchmark configuration: a fresh stack, a fresh load, the figures of every window.

A configuration is one stack (:class:`bench.harness.stack.StackSpec`) under one load
(call, connections, pacing). :func:`run_config` starts the stack, runs the load
(warm-up, then ``reps`` contiguous windows), samples the CPU of every role at each
window boundary and the RSS before connecting, once connected and at the end,
and tears everything down, whatever happened. The result is a JSON-able dict.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from bench.analysis import stats
from bench.harness.calls import panel_names, sample_call, zipf_views
from bench.load import frames
from bench.load.loadgen import LoadGenerator, LoadPlan, LoadResult, Window
from lookups.settings import SHIPPED_OPTIONAL

__all__ = [
    "Config",
    "Timing",
    "run_config",
    "loadgen_processes",
    "panel_names",
    "at_capacity_fraction",
    "plan_of",
    "measure",
    "DEADLINE_MS",
    "CALL_TIMEOUT_S",
]

DEADLINE_MS = 2000  # the deadline of every get_app_stats call (meta.deadline_ms), as the web tier's
#: How long a caller waits for any reply: the deadline plus AppStatsClient's reply margin;
#: a later reply is useless to the web tier, so it counts as a failed call ("timeout").
CALL_TIMEOUT_S = (DEADLINE_MS + 250) / 1000.0

_MACHINE = "machine"  # key of the machine-wide busy CPU among the samples


@dataclass(frozen=True)
class Timing:
    """How long each part of a configuration runs."""

    reps: int
    window_s: float
    warmup_s: float


@dataclass(frozen=True)
class Config:
    """One configuration. ``call`` is "ping", "stats" (get_app_stats, every panel, complete
    when all are OK), "stats_essential" (complete once the essential ones are, as brownout
    counts goodput), "stats_each_panel" (connection i asks for panel i only) or
    "stats_zipf" (one of twenty dashboards, :func:`~bench.harness.calls.zipf_views`).
    ``interval_s`` > 0 paces each connection to one call per interval; 0 is a closed loop."""

    key: str
    scenario: str
    label: str
    spec: Any  # bench.harness.stack.StackSpec
    call: str
    connections: int
    interval_s: float = 0.0
    decode_every: int = 0
    window_scale: float = 1.0  # this configuration's windows are this much longer
    reps_share: float = 1.0  # ...and it runs this share of the repetitions (rounds)
    processes: int = 0  # 0: loadgen_processes(connections)
    honour_retry_after: bool = False  # callers wait retry_after_ms after an Overloaded
    overloaded_pause_s: float = 0.0  # ...or else this long, whatever the reply asked for
    open_loop: bool = False  # with interval_s: keep the schedule (no coordinated omission)
    # > 0: interval_s is set when the run reaches this configuration: all connections offer
    # this fraction of the complete calls/s measured by ``capacity_of``.
    capacity_fraction: float = 0.0
    capacity_of: str = ""
    warmup_s: float = 0.0  # > 0: this configuration's own warm-up
    criticality: str = ""  # RequestMeta.criticality of every call ("": none)
    caller: str = ""  # RequestMeta.caller of every call ("": none, the anonymous caller)
    companion: Any = None  # a second group of callers (bench.harness.mixed)
    states: bool = False  # a Fanout server's admission and dimmer read at each window's end

    def timing(self, base: Timing) -> Timing:
        return dataclasses.replace(
            base,
            window_s=base.window_s * self.window_scale,
            warmup_s=self.warmup_s or base.warmup_s,
            reps=max(1, round(base.reps * self.reps_share)),
        )


def at_capacity_fraction(config: Config, earlier: list[dict[str, Any]]) -> Config:
    """``config`` with the ``interval_s`` that makes its connections offer
    ``capacity_fraction`` of the complete calls/s its ``capacity_of`` result measured.

    Raises :class:`ValueError` when that result is missing or measured nothing.
    """
    if config.capacity_fraction <= 0:
        return config
    probe = next((r for r in earlier if r.get("key") == config.capacity_of), None)
    rates = [r["rps"] for r in (probe or {}).get("reps", []) if r.get("rps", 0) > 0]
    if not rates:
        raise ValueError(f"no capacity measured by {config.capacity_of!r} for {config.key}")
    offered = config.capacity_fraction * sum(rates) / len(rates)
    return dataclasses.replace(config, interval_s=config.connections / offered)


def loadgen_processes(connections: int) -> int:
    """Load-generator processes for ``connections``: one gevent loop holds a few thousand."""
    if connections <= 50:
        return 1
    return 2 if connections <= 2000 else 4


def plan_of(config: Config, address: tuple[str, int], timing: Timing) -> LoadPlan:
    """The load generator's plan for ``config`` against ``address``."""
    encoded: tuple[bytes, ...]
    if config.call == "ping":
        method, encoded, expect_ok = "ping", (frames.ping_frame(),), 0
    elif config.call == "stats_zipf":
        method, expect_ok = "get_app_stats", len(panel_names())
        encoded = tuple(
            frames.stats_frame(*view, deadline_ms=DEADLINE_MS)
            for view in zipf_views(config.connections)
        )
    elif config.call in ("stats", "stats_essential") and (config.criticality or config.caller):
        method, expect_ok = "get_app_stats", _expect_ok(config.call)
        encoded = (
            frames.stats_frame(
                *sample_call(),
                deadline_ms=DEADLINE_MS,
                criticality=config.criticality,
                caller=config.caller,
            ),
        )
    else:
        app, start_ms, end_ms = sample_call()
        method = "get_app_stats"
        if config.call in ("stats", "stats_essential"):
            encoded = (frames.stats_frame(app, start_ms, end_ms, deadline_ms=DEADLINE_MS),)
            expect_ok = _expect_ok(config.call)
        else:
            encoded = tuple(
                frames.stats_frame(app, start_ms, end_ms, [p], deadline_ms=DEADLINE_MS)
                for p in panel_names()
            )
            expect_ok = 1
    return LoadPlan(
        address=address,
        method=method,
        frames=encoded,
        connections=config.connections,
        processes=config.processes or loadgen_processes(config.connections),
        warmup_s=timing.warmup_s,
        window_s=timing.window_s,
        reps=timing.reps,
        interval_s=config.interval_s,
        expect_ok=expect_ok,
        decode_every=config.decode_every,
        call_timeout_s=CALL_TIMEOUT_S,
        honour_retry_after=config.honour_retry_after,
        open_loop=config.open_loop,
        overloaded_pause_s=config.overloaded_pause_s,
    )


def _expect_ok(call: str) -> int:
    """OK panels a complete answer has: all, or for "stats_essential" the essential ones."""
    return len(panel_names() if call == "stats" else set(panel_names()) - SHIPPED_OPTIONAL)


def _percentiles(values: array[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan"), "n": 0}
    return {
        "p50_ms": stats.percentile(ordered, 50),
        "p99_ms": stats.percentile(ordered, 99),
        "mean_ms": sum(ordered) / len(ordered),
        "n": len(ordered),
    }


def _cpu_pct(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {
        role: 100.0 * (after.get(role, 0.0) - before.get(role, 0.0)) / seconds for role in after
    }


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all CPUs)."""
    times = psutil.cpu_times()
    return (
        times.user
        + times.system
        + getattr(times, "nice", 0.0)
        + getattr(times, "irq", 0.0)
        + getattr(times, "softirq", 0.0)
        + getattr(times, "steal", 0.0)
    )


def _rep_figures(
    window: Window, window_s: float, cpu_before: dict[str, float], cpu_after: dict[str, float]
) -> dict[str, Any]:
    pooled = array("d")
    for part in window.latencies_ms:
        pooled.extend(part)
    cpu = _cpu_pct(cpu_before, cpu_after, window_s)
    machine = cpu.pop(_MACHINE)
    loadgen = 100.0 * window.loadgen_cpu_s / window_s
    figures = {
        "rps": sum(window.ok) / window_s,
        "ok": sum(window.ok),
        "replies_per_s": (sum(window.ok) + sum(window.degraded)) / window_s,
        "degraded": sum(window.degraded),
        "failures": dict(window.failures),
        **_percentiles(pooled),
        "cpu_pct": cpu,
        "loadgen_cpu_pct": loadgen,
        # What else ran on the machine meanwhile (other users, the harness itself).
        "other_cpu_pct": max(0.0, machine - loadgen - sum(cpu.values())),
    }
    if len(window.latencies_ms) > 1:
        figures["frames"] = [_percentiles(part) for part in window.latencies_ms]
    return figures


def _add_mongo_commands(reps: list[dict[str, Any]], aggregations: list[int | None]) -> None:
    """Each window's MongoDB aggregations (``mongo_commands``) and their number per call
    answered, refused ones aside (``mongo_commands_per_reply``), where the responder counts
    them (``aggregations``: its count at each window's boundary)."""
    for i, rep in enumerate(reps):
        before, after = aggregations[i : i + 2] if i + 1 < len(aggregations) else (None, None)
        if before is None or after is None:
            continue
        replies = rep["ok"] + rep["degraded"]
        rep["mongo_commands"] = after - before
        rep["mongo_commands_per_reply"] = (after - before) / replies if replies else None


def _pooled(load: LoadResult) -> dict[str, Any]:
    frames_n = len(load.windows[0].latencies_ms) if load.windows else 0
    per_frame = [array("d") for _ in range(frames_n)]
    for window in load.windows:
        for f, part in enumerate(window.latencies_ms):
            per_frame[f].extend(part)
    everything = array("d")
    for part in per_frame:
        everything.extend(part)
    pooled: dict[str, Any] = dict(_percentiles(everything))
    if frames_n > 1:
        pooled["frames"] = [_percentiles(part) for part in per_frame]
    return pooled


def _server_side(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per panel, the median elapsed time the server reported; and the slowest per request."""
    if not samples:
        return {}
    by_panel: dict[str, list[float]] = {}
    slowest = []
    for sample in samples:
        for name, elapsed in sample["outcomes_ms"].items():
            by_panel.setdefault(name, []).append(elapsed)
        if sample["outcomes_ms"]:
            slowest.append(max(sample["outcomes_ms"].values()))
    median = {name: stats.percentile(sorted(v), 50) for name, v in by_panel.items()}
    return {
        "samples": len(samples),
        "panel_p50_ms": median,
        "slowest_outcome_p50_ms": stats.percentile(sorted(slowest), 50) if slowest else None,
    }


def _sum_failures(load: LoadResult) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in [load.connect_failures, load.outside_failures] + [w.failures for w in load.windows]:
        for kind, count in part.items():
            total[kind] = total.get(kind, 0) + count
    return total


def run_config(
    config: Config,
    base: Timing,
    on_window: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run ``config`` on a fresh stack and return its figures; never raises for a
    failed run: the result then carries ``"error"`` (and whatever was measured)."""
    from bench.harness.stack import start_stack

    timing = config.timing(base)
    result: dict[str, Any] = {
        "key": config.key,
        "scenario": config.scenario,
        "label": config.label,
        "spec": dataclasses.asdict(config.spec),
        "call": config.call,
        "connections": config.connections,
        "interval_s": config.interval_s,
        "reps_planned": timing.reps,
        "window_s": timing.window_s,
        "warmup_s": timing.warmup_s,
    }
    started = time.monotonic()
    try:
        if config.companion is not None:
            from bench.harness.mixed import run_mixed

            run_mixed(config, timing, result, on_window, sys.modules[__name__])
        else:
            # Started first so that their start-up overlaps the stack's; they end before it.
            with LoadGenerator(config.processes or loadgen_processes(config.connections)) as load:
                with start_stack(config.spec) as stack:
                    result["startup_s"] = time.monotonic() - started
                    measure(config, stack, load, timing, result, on_window)
                    torn_down = time.monotonic()
                result["teardown_s"] = time.monotonic() - torn_down
    except Exception as exc:  # one broken configuration must not end the whole run
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["total_s"] = time.monotonic() - started
    return result


def measure(
    config: Config,
    stack: Any,
    generator: LoadGenerator,
    timing: Timing,
    result: dict[str, Any],
    on_window: Callable[[], None],
) -> None:
    """Run ``config``'s load from ``generator`` on ``stack``; its figures into ``result``."""
    if hasattr(stack, "describe"):
        result["stack"] = stack.describe()
    rss = {"before_connect": stack.rss_kib()}
    cpu: list[dict[str, float]] = []
    states: list[dict[str, Any]] = []
    server_rss: list[int] = []  # KiB, at each window's boundary
    aggregations: list[int | None] = []  # the MongoDB responder's, at each boundary

    def boundary(i: int) -> None:
        cpu.append({**stack.cpu_seconds(), _MACHINE: _machine_busy_s()})
        server_rss.append(stack.rss_kib()["server"])
        if hasattr(stack, "mongo_aggregations"):
            aggregations.append(stack.mongo_aggregations())
        if config.states and i > 0:
            states.append(_server_state(stack.address))
        if i > 0:
            on_window()

    def ready() -> None:
        rss["connected"] = stack.rss_kib()

    plan = plan_of(config, stack.address, timing)
    load = generator.run(plan, on_ready=ready, on_boundary=boundary)
    rss["end_of_load"] = stack.rss_kib()
    if hasattr(stack, "otlp_stats"):
        result["otlp_received"] = stack.otlp_stats()  # None without a sink
    reps = [
        _rep_figures(w, timing.window_s, cpu[i], cpu[i + 1]) for i, w in enumerate(load.windows)
    ]
    _add_mongo_commands(reps, aggregations)
    result.update(
        processes=plan.processes,
        address=list(stack.address),
        reps=reps,
        pooled=_pooled(load),
        failures_total=_sum_failures(load),
        degraded_total=sum(r["degraded"] for r in reps),
        connected=load.connected,
        connect_s=load.connect_s,
        unfinished_at_end=load.unfinished,
        monitor_cut=load.monitor_cut,
        rss_kib=rss,
        server_rss_kib=server_rss,
        server_side=_server_side(load.samples),
        server_pids=len(stack.server_pids()),
    )
    if config.spec.server == "fanout":
        result["tasks"] = _task_counts(stack.address)
    if states:
        result["states"] = states
    if config.companion is not None:
        result["samples"] = load.samples  # every decoded reply, for bench.harness.mixed


def _server_state(address: tuple[str, int]) -> dict[str, Any]:
    """A Fanout server's admission limit, calls in flight and queued, and the dimmer's
    level and its calls answered lighter and shed so far (its ``pool_stats``), now."""
    from service.client import AppStatsClient

    try:
        with AppStatsClient(address[0], address[1], timeout_ms=5000) as client:
            report = client.pool_stats()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "limit": report.admission_limit,
        "inflight": report.calls_in_flight,
        "queued": report.calls_queued,
        "brownout_level": report.brownout_level,
        "lighter": report.calls_lighter,
        "shed": report.calls_shed,
    }


def _task_counts(address: tuple[str, int]) -> dict[str, Any]:
    """Tasks the server started and those that shared a call (its ``pool_stats``), so far."""
    from service.client import AppStatsClient

    try:
        with AppStatsClient(address[0], address[1], timeout_ms=5000) as client:
            report = client.pool_stats()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"started": report.tasks_started or 0, "coalesced": report.tasks_coalesced or 0}
