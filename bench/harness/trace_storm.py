"""The trace-storm scenario: tail capture under a storm of failing calls, for minutes.

Every request to the HTTP services is answered with a body cut short, so every call has
panels not OK and tail capture would keep each one; a closed loop at 50 connections asks
for more of them a second than ``tracing.tail_max_per_s`` (as shipped) lets through, so
the ceiling drops the rest. Sampled at 1% at the head, as operators run it. Over five
minutes of measured windows the server's memory must stay flat: records live only as
long as their call, kept calls leave through the batch processor's bounded queue, and the
excess is counted and dropped. Reported: the server's RSS at each window's end, the
calls answered a second, and what the OTLP sink received.
"""

from __future__ import annotations

from typing import Any

from bench.analysis.goals import Goal, info_row, ratio_goal
from bench.harness.runner import Config
from bench.harness.scenario import Results, Scale, Scenario, _config, _per_rep

__all__ = ["trace_storm"]

NAME = "trace-storm"
CONNECTIONS = 50
#: Windows twenty times the default's (10 s), each a repetition: 30 of them make five minutes.
WINDOW_SCALE = 20.0
WARMUP_S = 30.0
#: Calls kept by their tail a second at most: a fifth of what the storm fails here.
CEILING = 20
#: RSS of the last minute over that of the second (the first is the heap's growth to its
#: working size): at most this.
RSS_LIMIT = 1.01


def _storm(scale: Scale) -> Config:
    return _config(
        NAME,
        "fanout",
        "stats",
        CONNECTIONS,
        label="failing-ratio1",
        tracing="ratio1",
        http_fail_every=1,
        tail_max_per_s=CEILING,
        window_scale=2.0 if scale.quick else WINDOW_SCALE,
        warmup_s=5.0 if scale.quick else WARMUP_S,
    )


def _minutes(rss_kib: list[int], window_s: float) -> list[list[float]]:
    """The RSS samples (MiB) of each whole minute, in order."""
    per_minute = max(1, round(60.0 / window_s))
    return [
        [kib / 1024 for kib in rss_kib[start : start + per_minute]]
        for start in range(0, len(rss_kib) - per_minute + 1, per_minute)
    ]


def _goals(results: Results) -> list[Goal]:
    result: dict[str, Any] = results.get(f"{NAME}/failing-ratio1/c{CONNECTIONS}") or {}
    reps = result.get("reps") or []
    window_s = result.get("window_s") or 10.0
    minutes = _minutes(result.get("server_rss_kib") or [], window_s)
    second, last = (minutes[1], minutes[-1]) if len(minutes) >= 3 else ([], [])
    rss = ", ".join(f"{sum(m) / len(m):.1f}" for m in minutes)
    received = result.get("otlp_received") or {}
    # The sink counts from the stack's start: over the warm-up and the windows alike.
    seconds = max(1.0, result.get("warmup_s", 0.0) + len(reps) * window_s)
    answered = _per_rep(result, "replies_per_s")
    return [
        ratio_goal(
            NAME,
            "server RSS, last minute / second minute, storm of failing calls at the ceiling",
            last,
            second,
            limit=RSS_LIMIT,
            at_most=True,
        ),
        info_row(NAME, "server RSS each minute (MiB)", rss or "n/a"),
        info_row(
            NAME,
            "calls answered a second, every one with panels failed",
            f"{sum(answered) / len(answered):.0f}" if answered else "n/a",
        ),
        info_row(
            NAME,
            "OTLP export requests and KiB a second received by the sink",
            f"{received.get('requests', 0) / seconds:.1f}, "
            f"{received.get('bytes', 0) / 1024 / seconds:.0f}"
            if received
            else "n/a",
        ),
    ]


def trace_storm(scale: Scale) -> Scenario:
    notes = [
        f"Closed loop at {CONNECTIONS} connections, every HTTP request answered with a body "
        "cut short (every call fails panels); 1% head sampling with tail capture, at most "
        f"{CEILING} calls kept by their tail a second (tracing.tail_max_per_s); OTLP/HTTP "
        "export to a local sink. "
        f"{WARMUP_S:.0f} s of warm-up, then five minutes of windows; the server's RSS read "
        "at each window's end."
    ]
    return Scenario(
        NAME, "Tail capture under a storm of failing calls", [_storm(scale)], _goals, notes
    )
