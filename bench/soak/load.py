"""The soak run's valid load: varied calls with varied deadlines, and what came back.

A call is *hung* when no answer or error arrived within its deadline plus HUNG_AFTER_S
(the client itself gives up at deadline + 250 ms, so this should never happen), and
*late* when it took longer than its deadline plus LATE_AFTER_S.
"""

from __future__ import annotations

import gc
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent.event import Event
from greenlet import greenlet
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from service.client import AppStatsClient
from service.idl import appstats
from service.samples import APPS, SAMPLE_END_MS, SAMPLE_START_MS
from tracing.context import TaskRunners

__all__ = [
    "HUNG_AFTER_S",
    "LATE_AFTER_S",
    "LoadStats",
    "run_worker",
    "sample_hub_lag",
    "live_greenlets",
    "rss_kib",
]

HUNG_AFTER_S = 5.0
LATE_AFTER_S = 1.0
_PANELS = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]
_DEADLINES_MS = [150, 300, 600, 1000, 1500, 2500]
_HOUR_MS = 3_600_000
_THINK_S = (0.05, 0.3)
_STATUS_NAMES: dict[int, str] = appstats.TaskStatus._VALUES_TO_NAMES


class _Hung(Exception):
    """Raised in a caller whose call outlived its deadline by HUNG_AFTER_S."""


@dataclass
class LoadStats:
    """Everything the callers saw."""

    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    calls: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    late: int = 0
    hung: int = 0
    worst_overrun_s: float = 0.0
    hub_lag_ms: list[float] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def record(self, answer: str, outcomes: Any, elapsed_s: float, deadline_ms: int) -> None:
        self.calls += 1
        self.answers[answer] += 1
        for outcome in outcomes or ():
            self.statuses[_STATUS_NAMES.get(outcome.status, str(outcome.status))] += 1
            if outcome.error_type:
                self.errors[outcome.error_type] += 1
        overrun = elapsed_s - deadline_ms / 1000
        self.worst_overrun_s = max(self.worst_overrun_s, overrun)
        self.late += overrun > LATE_AFTER_S
        self.ended = time.monotonic()

    def progress(self) -> str:
        return f"calls={self.calls} ok={self.answers['ok']} late={self.late} hung={self.hung}"

    def summary(self) -> list[str]:
        rate = self.calls / self.duration_s if self.duration_s else 0.0
        return [
            f"calls made: {self.calls} ({rate:.1f}/s)",
            "answers: " + _counts(self.answers),
            "outcomes by status: " + _counts(self.statuses),
            "errors by kind: " + _counts(self.errors),
            f"late (past deadline + {LATE_AFTER_S:.0f} s): {self.late}; "
            f"hung (past deadline + {HUNG_AFTER_S:.0f} s): {self.hung}; "
            f"worst overrun past the deadline: {self.worst_overrun_s * 1000:.0f} ms",
            f"event-loop lag (100 ms sleeps): {_lag_summary(self.hub_lag_ms)}",
        ]


def _lag_summary(lags_ms: list[float]) -> str:
    if not lags_ms:
        return "not sampled"
    ordered = sorted(lags_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"median {ordered[len(ordered) // 2]:.0f} ms, p99 {p99:.0f} ms, max {ordered[-1]:.0f} ms"


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counter.most_common()) or "none"


def _random_call(rng: random.Random) -> dict[str, Any]:
    app = rng.choice(APPS) if rng.random() > 0.03 else rng.choice(["no/such", "", "x" * 65])
    start_ms = SAMPLE_START_MS + rng.randrange(24) * _HOUR_MS
    end_ms = min(start_ms + rng.choice([1, 2, 6, 12, 24]) * _HOUR_MS, SAMPLE_END_MS)
    panels = None if rng.random() < 0.4 else rng.sample(_PANELS, rng.randint(1, len(_PANELS)))
    return {
        "app": app,
        "start_ms": start_ms,
        "end_ms": end_ms,
        "panels": panels,
        "deadline_ms": rng.choice(_DEADLINES_MS),
    }


def _call_once(client: AppStatsClient, rng: random.Random, stats: LoadStats) -> None:
    call = _random_call(rng)
    deadline_ms = call["deadline_ms"]
    answer, outcomes = "ok", None
    started = time.monotonic()
    try:
        with gevent.Timeout(deadline_ms / 1000 + HUNG_AFTER_S, _Hung):
            outcomes = client.get_app_stats(**call).outcomes
    except appstats.InvalidRequest:
        answer = "InvalidRequest"
    except appstats.Overloaded:
        answer = "Overloaded"
    except appstats.PanelFailed as failed:
        answer, outcomes = "PanelFailed", failed.outcomes
    except TTransportException:
        answer = "transport error"
    except TApplicationException:
        answer = "application error"
    except _Hung:
        stats.hung += 1
        answer = "hung"
    stats.record(answer, outcomes, time.monotonic() - started, deadline_ms)


def run_worker(address: tuple[str, int], rng: random.Random, stop: Event, stats: LoadStats) -> None:
    """Call the server until ``stop``, pausing between calls as a web tier would."""
    with AppStatsClient(*address, pool_size=1, timeout_ms=3000) as client:
        while not stop.is_set():
            _call_once(client, rng, stats)
            stop.wait(rng.uniform(*_THINK_S))


def sample_hub_lag(stop: Event, lags_ms: list[float]) -> None:
    """How late a 100 ms sleep wakes up, every 100 ms: the event loop's responsiveness."""
    while not stop.is_set():
        started = time.monotonic()
        gevent.sleep(0.1)
        lags_ms.append((time.monotonic() - started - 0.1) * 1000.0)


_PARKED = getattr(getattr(TaskRunners, "_park", None), "__code__", None)


def live_greenlets() -> tuple[int, int]:
    """Greenlets not yet finished in this process: (working or waiting, parked task runners).

    The engine parks finished task greenlets for reuse (``TaskRunners``); those wait for
    work and are counted apart.
    """
    live = parked = 0
    # type(), not isinstance(): the heap holds weak proxies, and a dead one raises on isinstance.
    for o in gc.get_objects():
        if issubclass(type(o), greenlet) and not o.dead:
            if o.gr_frame is not None and o.gr_frame.f_code is _PARKED:
                parked += 1
            else:
                live += 1
    return live, parked


def rss_kib() -> int:
    """This process's resident set size, in KiB (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
