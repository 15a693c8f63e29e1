"""Micro-benchmarks of the engine: per-task overhead, memory per task and per connection, and
the CPU of one span.

``python -m bench.micro [--quick]`` prints the JSON of :func:`run_micro`::

    {"task_overhead_us": {"p50", "p99", "mean", "ci95", "reps", "tasks_per_run", "runs_per_rep"},
     "rss_per_inflight_task_kib": {"mean", "n", "rss_before_kib", "rss_during_kib"},
     "rss_per_idle_connection_kib": {"mean", "n", "rss_before_kib", "rss_during_kib"},
     "span_cost_us": {"sdk", "encode", "task_span": {"p50", "p99", "mean", "ci95"}}}

Why not pyperf: two of the figures are memory (RSS per task, per connection),
which pyperf does not measure, and the timing probe must run under gevent's
patching inside a hub, where pyperf's runner, which owns the command line and
spawns and calibrates its own workers, cannot host it without wrapping the probe
anyway.

Every figure comes from a fresh subprocess, so what the calling process has
installed (a tracer provider, monkey-patching, warm caches) does not leak in:

* **task overhead**: ``FanOut.run`` over trivial tasks (return at once), without
  tracing (no provider installed: the span helpers get the API's no-op tracer).
  One rep times ``runs_per_rep`` runs of ``tasks_per_run`` tasks; its figure is
  the wall time per task in microseconds: spawn in a copied context, the two
  slots, the task span, the outcome, the join. ``p50``/``p99`` are over reps.
* **RSS per in-flight task**: ``n`` tasks started by one ``FanOut.run`` and parked
  on an event, RSS measured while all are running; (during - before) / n.
* **RSS per idle connection**: ``fanout serve`` with tracing off; ``n`` client
  connections from this process, each makes one ``ping`` and then stays idle;
  the server's (during - before) / n.
* **CPU of one span** (:mod:`bench.span_cost`): the OpenTelemetry SDK's own work, with
  Fanout's OTLP encoding, and through Fanout's task-span helper, per span.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

__all__ = ["run_micro"]

_GOALS = {
    "task_overhead_us": 25.0,
    "rss_per_inflight_task_kib": 12.0,
    "rss_per_idle_connection_kib": 16.0,
}
_PROBE_TIMEOUT_S = 300
_WARMUP_TASKS = 50


def run_micro(reps: int = 30, quick: bool = False) -> dict[str, Any]:
    """Run the micro-benchmarks, each in a fresh subprocess; return their figures.

    ``quick`` shrinks the work (fewer runs per rep, fewer tasks and connections)
    for a smoke run. Raises ``RuntimeError`` if a probe process fails.
    """
    reps = max(reps, 30)
    inflight_n = 2_000 if quick else 10_000
    connections_n = 500 if quick else 2_000
    return {
        "task_overhead_us": _probe(
            "engine", "--reps", str(reps), "--runs-per-rep", "20" if quick else "200"
        ),
        "rss_per_inflight_task_kib": _probe("inflight", "--n", str(inflight_n)),
        "rss_per_idle_connection_kib": measure_idle_connections(connections_n),
        "span_cost_us": _probe("spans", "--reps", str(reps), "--n", "500" if quick else "4000"),
        "goals": dict(_GOALS),
    }


def _probe(name: str, *args: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.micro", "--probe", name, *args]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=_PROBE_TIMEOUT_S,
        cwd=_project_root(),
        env=_quiet_env(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"probe {name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quiet_env() -> dict[str, str]:
    return {**os.environ, "OTEL_TRACES_EXPORTER": "none", "FANOUT_TRACING_ENABLED": "false"}


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    mean = statistics.fmean(ordered)
    spread = statistics.stdev(ordered) if len(ordered) > 1 else 0.0
    return {
        "p50": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 3),
        "mean": round(mean, 3),
        "ci95": round(1.96 * spread / math.sqrt(len(ordered)), 3),
    }


# --- probes (run in their own process, monkey-patched) -----------------------------------------


def _probe_engine(reps: int, runs_per_rep: int, tasks_per_run: int) -> dict[str, Any]:
    from service.engine import FanOut, FanOutSettings, RequestContext, Task

    fanout = FanOut(FanOutSettings(pool_size=tasks_per_run, max_inflight_tasks=10 * tasks_per_run))
    tasks = [
        Task(name=f"t{i}", source="micro", call=_trivial, timeout_ms=1000)
        for i in range(tasks_per_run)
    ]
    samples = []
    for rep in range(reps + 3):  # the first reps warm up caches and the allocator
        began = time.perf_counter()
        for _ in range(runs_per_rep):
            fanout.run(tasks, RequestContext.start("get_app_stats", 60_000))
        if rep >= 3:
            samples.append((time.perf_counter() - began) * 1e6 / (runs_per_rep * tasks_per_run))
    return {
        **_summary(samples),
        "reps": reps,
        "runs_per_rep": runs_per_rep,
        "tasks_per_run": tasks_per_run,
    }


def _trivial(deadline: Any) -> str:
    return "ok"


def _probe_inflight(n: int) -> dict[str, Any]:
    import gc

    import gevent
    from gevent.event import Event

    from service.engine import FanOut, FanOutSettings, RequestContext, Task
    from tracing.context import spawn_in_context

    release = Event()

    def parked(deadline: Any) -> None:
        release.wait()

    fanout = FanOut(
        FanOutSettings(
            pool_size=n,
            max_inflight_tasks=n,
            queue_timeout_ms=60_000,
            request_deadline_ms=600_000,
            task_timeout_ms=600_000,
        )
    )
    tasks = [Task(name=f"t{i}", source="micro", call=parked, timeout_ms=600_000) for i in range(n)]
    # Warm up the code paths with a few tasks only: memory a big warm-up freed would be
    # reused by the measured run and hide what each task really holds.
    warm = spawn_in_context(
        fanout.run, tasks[:_WARMUP_TASKS], RequestContext.start("get_app_stats", 600_000)
    )
    _wait_until(lambda: fanout.inflight == _WARMUP_TASKS)
    release.set()
    warm.get(timeout=60)
    release.clear()
    gc.collect()
    before = _own_rss_kib()
    runner = spawn_in_context(fanout.run, tasks, RequestContext.start("get_app_stats", 600_000))
    _wait_until(lambda: fanout.inflight == n)
    gevent.sleep(0.05)
    during = _own_rss_kib()
    release.set()
    runner.get(timeout=60)
    return {
        "mean": round((during - before) / n, 3),
        "n": n,
        "rss_before_kib": before,
        "rss_during_kib": during,
    }


def _wait_until(condition: Any, timeout_s: float = 60.0) -> None:
    import gevent

    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise RuntimeError("condition not reached in time")
        gevent.sleep(0.01)


def _own_rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


# --- RSS per idle connection (a real server process) -------------------------------------------


def measure_idle_connections(n: int, warmup: int = 50) -> dict[str, Any]:
    """Start ``fanout serve`` (tracing off), hold ``n`` idle connections, return the server's RSS per connection."""
    # Imported here: this module's probes patch the standard library before it loads.
    from service.samples.mongo_server import stop_process

    _raise_fd_limit(n + warmup + 200)
    env = {
        **_quiet_env(),
        "FANOUT_SERVER_MAX_CONNECTIONS": str(n + warmup + 100),
        "FANOUT_SERVER_IDLE_TIMEOUT_MS": "600000",
        "FANOUT_MONGO_URI": "mongodb://127.0.0.1:9",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=_project_root(),
        env=env,
    )
    held: list[socket.socket] = []
    try:
        address = _wait_for_address(server)
        for sock in [_ping(address) for _ in range(warmup)]:
            sock.close()
        time.sleep(0.5)
        before = _rss_kib(server.pid)
        held = [_ping(address) for _ in range(n)]
        time.sleep(0.5)
        during = _rss_kib(server.pid)
    finally:
        for sock in held:
            sock.close()
        stop_process(server, timeout_s=15, kill_wait_s=10)
    return {
        "mean": round((during - before) / n, 3),
        "n": n,
        "rss_before_kib": before,
        "rss_during_kib": during,
    }


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def _wait_for_address(server: subprocess.Popen[Any], timeout_s: float = 60.0) -> tuple[str, int]:
    give_up = time.monotonic() + timeout_s
    assert server.stdout is not None
    while time.monotonic() < give_up:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError("fanout serve ended before it was serving")
        found = re.search(r"serving on (\S+):(\d+)", line)
        if found:
            return found.group(1), int(found.group(2))
    raise RuntimeError("fanout serve did not start in time")


# A framed, strict-binary ``ping()`` call, sequence id 0: the bytes any Thrift client sends.
_PING_BODY = struct.pack("!iI", -2147418111, 4) + b"ping" + struct.pack("!i", 0) + b"\x00"
_PING = struct.pack("!i", len(_PING_BODY)) + _PING_BODY


def _ping(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=30)
    sock.sendall(_PING)
    length = struct.unpack("!i", _read_exactly(sock, 4))[0]
    _read_exactly(sock, length)
    return sock


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise RuntimeError("server closed the connection")
        data += chunk
    return data


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="less work, for a smoke run")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--probe", choices=["engine", "inflight", "spans"], help=argparse.SUPPRESS)
    parser.add_argument("--runs-per-rep", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--tasks-per-run", type=int, default=7, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=10_000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe == "engine":
        result = _probe_engine(args.reps, args.runs_per_rep, args.tasks_per_run)
    elif args.probe == "inflight":
        result = _probe_inflight(args.n)
    elif args.probe == "spans":
        from bench.span_cost import measure_span_cost

        samples = measure_span_cost(args.reps, args.n)
        result = {name: _summary(values) for name, values in samples.items()}
    else:
        result = run_micro(args.reps, args.quick)
    print(json.dumps(result, indent=None if args.probe else 2))
    return 0


if __name__ == "__main__":
    from gevent import monkey

    monkey.patch_all()
    sys.exit(main())
