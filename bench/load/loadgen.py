"""The load generator, parent side: plan a load, run it in separate processes, collect windows.

:func:`run_load` starts ``plan.processes`` fresh processes (``python -m
bench.load.loadgen_worker``), splits the connections between them, waits until every
connection is open, then gives all of them the same start time on the
system-wide monotonic clock. Windows are contiguous: a warm-up, then ``reps``
measured windows of ``window_s`` each. At each window boundary ``on_boundary``
is called (the caller samples server CPU there), and the load generator's own
CPU (user + system of its processes) is sampled, so every window carries what the
load cost to generate.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

__all__ = ["LoadPlan", "Window", "LoadResult", "LoadError", "LoadGenerator", "run_load"]

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_START_DELAY_S = 0.3  # between "go" and the start, so every process has it in time
_RESULT_TIMEOUT_S = 60.0


class LoadError(RuntimeError):
    """A load-generator process failed, or did not answer in time."""


@dataclass(frozen=True)
class LoadPlan:
    """What to send, over how many connections and processes, for how long.

    ``frames`` are pre-encoded calls; connection i sends ``frames[i % len(frames)]``.
    ``interval_s`` 0 is a closed loop, else each connection calls once per interval.
    ``expect_ok`` > 0 makes a reply with fewer OK outcomes "degraded".
    ``decode_every`` n > 0 fully decodes about one successful reply in n (samples).
    ``honour_retry_after``: after an ``Overloaded`` reply a connection waits its
    ``retry_after_ms`` x uniform(0.5, 1.5) before calling again, as
    ``service.client.AppStatsClient`` does; otherwise it calls again after
    ``overloaded_pause_s`` (0: at once), whatever the reply asked for.
    ``open_loop`` (with ``interval_s`` > 0): calls keep to their schedule, as wrk2 does;
    a call that could not start on time (its connection was still waiting for the
    previous reply) starts at once, and its latency counts from when it should have
    started, so a stall is not hidden by the calls it delayed (coordinated omission).
    """

    address: tuple[str, int]
    method: str
    frames: tuple[bytes, ...]
    connections: int
    processes: int
    warmup_s: float
    window_s: float
    reps: int
    interval_s: float = 0.0
    expect_ok: int = 0
    decode_every: int = 0
    honour_retry_after: bool = False
    overloaded_pause_s: float = 0.0
    open_loop: bool = False
    call_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    connect_concurrency: int = 200
    seed: int = 1


@dataclass
class Window:
    """One measured window, summed over the processes; latencies of ok+degraded calls."""

    ok: list[int]
    degraded: list[int]
    failures: dict[str, int]
    latencies_ms: list[array[float]]
    loadgen_cpu_s: float = 0.0


@dataclass
class LoadResult:
    windows: list[Window]
    connected: int
    connect_failures: dict[str, int]
    outside_failures: dict[str, int]  # during warm-up or after the last window
    samples: list[dict[str, Any]]
    unfinished: int
    connect_s: float
    monitor_cut: int = 0  # replies with a panel failed by pymongo's monitor (frames.py)
    pids: list[int] = field(default_factory=list)


class _Child:
    """One worker process with a thread reading its stdout lines and its stderr tail."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.load.loadgen_worker"],
            cwd=_PROJECT_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ps = psutil.Process(self.process.pid)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_tail = ([*self.stderr_tail, line])[-30:]

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def receive(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next message, which must be ``event``; raises LoadError otherwise."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise LoadError(
                f"load generator {self.process.pid}: no {event!r} within {timeout_s:.0f} s"
            ) from None
        if line is None:
            raise LoadError(
                f"load generator exited ({self.process.wait(5)}): "
                + "".join(self.stderr_tail)[-2000:]
            )
        message = json.loads(line)
        if message.get("event") != event:
            raise LoadError(f"load generator: expected {event!r}, got {message.get('event')!r}")
        return message

    def cpu_s(self) -> float:
        try:
            times = self.ps.cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def _plans(plan: LoadPlan) -> list[dict[str, Any]]:
    base = {
        "host": plan.address[0],
        "port": plan.address[1],
        "method": plan.method,
        "frames": [base64.b64encode(f).decode("ascii") for f in plan.frames],
        "warmup_s": plan.warmup_s,
        "window_s": plan.window_s,
        "reps": plan.reps,
        "interval_s": plan.interval_s,
        "expect_ok": plan.expect_ok,
        "decode_every": plan.decode_every,
        "call_timeout_s": plan.call_timeout_s,
        "honour_retry_after": plan.honour_retry_after,
        "open_loop": plan.open_loop,
        "overloaded_pause_s": plan.overloaded_pause_s,
        "connect_timeout_s": plan.connect_timeout_s,
        "connect_concurrency": plan.connect_concurrency,
    }
    shares, offset = [], 0
    for i in range(plan.processes):
        count = plan.connections // plan.processes + (i < plan.connections % plan.processes)
        shares.append(
            {**base, "connections": count, "conn_offset": offset, "seed": plan.seed * 1000 + i}
        )
        offset += count
    return shares


def _merge(plan: LoadPlan, results: list[dict[str, Any]], cpu: list[float]) -> list[Window]:
    frames = len(plan.frames)
    windows = []
    for w in range(plan.reps):
        window = Window(
            [0] * frames,
            [0] * frames,
            {},
            [array("d") for _ in range(frames)],
            loadgen_cpu_s=cpu[w + 1] - cpu[w],
        )
        for result in results:
            part = result["windows"][w]
            for f in range(frames):
                window.ok[f] += part["ok"][f]
                window.degraded[f] += part["degraded"][f]
                window.latencies_ms[f].frombytes(base64.b64decode(part["latencies_ms"][f]))
            for kind, count in part["failures"].items():
                window.failures[kind] = window.failures.get(kind, 0) + count
        windows.append(window)
    return windows


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for kind, count in d.items():
            total[kind] = total.get(kind, 0) + count
    return total


def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class LoadGenerator:
    """``processes`` fresh load-generator processes, started at construction so that
    their start-up (Python, gevent, thriftpy2 imports) overlaps the stack's. Used once:
    :meth:`run` ends them, also when it raises. A context manager."""

    def __init__(self, processes: int) -> None:
        self._children: list[_Child] = []
        try:
            self._children = [_Child() for _ in range(processes)]
        except BaseException:
            self.close()
            raise

    def run(
        self,
        plan: LoadPlan,
        on_ready: Callable[[], None] = lambda: None,
        on_boundary: Callable[[int], None] = lambda i: None,
    ) -> LoadResult:
        """Run ``plan``; ``on_ready`` is called once every connection is open (before the
        load), ``on_boundary(i)`` at the start of window i and ``on_boundary(reps)`` at
        the end. Raises LoadError if a process fails or does not answer in time, and
        ValueError if ``plan.processes`` differs from the processes started."""
        children = self._children
        if plan.processes != len(children):
            raise ValueError(f"plan for {plan.processes} processes, {len(children)} started")
        try:
            for child, share in zip(children, _plans(plan)):
                child.send(json.dumps(share))
            ready_timeout = plan.connect_timeout_s * 3 + plan.connections / 50 + 30
            ready = [child.receive("ready", ready_timeout) for child in children]
            on_ready()
            go_at = time.monotonic() + _START_DELAY_S
            for child in children:
                child.send(json.dumps({"go": go_at}))
            measure_start = go_at + plan.warmup_s
            cpu = []
            for i in range(plan.reps + 1):
                _sleep_until(measure_start + i * plan.window_s)
                cpu.append(sum(child.cpu_s() for child in children))
                on_boundary(i)
            results = [child.receive("result", _RESULT_TIMEOUT_S) for child in children]
        finally:
            self.close()
        return LoadResult(
            windows=_merge(plan, results, cpu),
            connected=sum(r["connected"] for r in ready),
            connect_failures=_sum_dicts([r["connect_failures"] for r in ready]),
            outside_failures=_sum_dicts([r["outside_failures"] for r in results]),
            samples=[s for r in results for s in r["samples"]],
            unfinished=sum(r["unfinished"] for r in results),
            monitor_cut=sum(r["monitor_cut"] for r in results),
            connect_s=max(r["connect_s"] for r in ready),
            pids=[r["pid"] for r in ready],
        )

    def close(self) -> None:
        """Kill the processes that are still running; idempotent."""
        for child in self._children:
            child.stop()

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_load(
    plan: LoadPlan,
    on_ready: Callable[[], None] = lambda: None,
    on_boundary: Callable[[int], None] = lambda i: None,
) -> LoadResult:
    """Start ``plan.processes`` processes and :meth:`LoadGenerator.run` the plan on them."""
    with LoadGenerator(plan.processes) as generator:
        return generator.run(plan, on_ready, on_boundary)
