"""What an idle server costs: one ``fanout serve`` as shipped, and no calls.

    python -m bench.idle [--seconds 60] [--windows 6]                  (make bench-idle)

Starts the sample backends (``fanout backends``: a MongoDB-wire server and the two
HTTP services) on free ports, and one ``fanout serve`` over them with every other
setting at its default. Once it has served a ping and settled, its CPU is read from
``/proc`` (each thread's run time, ``schedstat``) over ``--windows`` windows that
together last ``--seconds``: milliseconds of CPU a second with a 95% interval, and each
thread's part. Then the same with the hub monitor off
(``server.hub_block_threshold_ms = 0``), which is the one part that runs in a thread
of its own. Bounded: it stops by itself, and stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.analysis.goals import info_row, value_goal
from bench.analysis.report import machine_facts
from bench.analysis.stats import Estimate, mean_ci
from bench.dashboard_stack import FANOUT
from service.client import AppStatsClient
from service.samples.mongo_server import free_port, stop_process

RESULTS = Path(__file__).resolve().parent / "results" / "idle.json"
#: Seconds after the first ping before the CPU is read: start-up's own work is over.
SETTLE_S = 10.0
GOAL_MS_PER_S = 2.0


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """Each thread's run time so far, in ns, by thread id (``/proc/<pid>/task``)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return times


def _wait_for_ports(ports: dict[str, int]) -> None:
    """Until every sample backend accepts connections (a minute at most)."""
    deadline = time.monotonic() + 60
    for port in ports.values():
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sample backends did not listen on {port}") from None
                time.sleep(0.2)


def _wait_for_ping(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with AppStatsClient("127.0.0.1", port, timeout_ms=1000) as client:
                if client.ping() == "pong":
                    return
        except Exception:  # not serving yet
            time.sleep(0.2)
    raise RuntimeError(f"fanout serve did not start: see {log}")


def measure(config: Path, env: dict[str, str], seconds: float, windows: int) -> dict[str, Any]:
    """One ``fanout serve --config config`` under ``env``, idle: its CPU a second."""
    port = free_port()
    log = config.with_suffix(f".{port}.log")
    with log.open("w") as out:
        process = subprocess.Popen(
            [*FANOUT, "serve", "--config", str(config), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            _wait_for_ping(port, process, log)
            time.sleep(SETTLE_S)
            first = before = thread_cpu_ns(process.pid)
            per_window = []
            for _ in range(windows):
                began = time.monotonic()
                time.sleep(seconds / windows)
                after = thread_cpu_ns(process.pid)
                spent_ns = sum(after.values()) - sum(before.get(t, 0) for t in after)
                per_window.append(spent_ns / 1e6 / (time.monotonic() - began))
                before = after
        finally:
            stop_process(process, timeout_s=10)
    main_thread = str(process.pid)
    threads = {
        "event loop (main thread)" if tid == main_thread else f"thread {index}": round(
            (spent - first.get(tid, 0)) / 1e6 / seconds, 3
        )
        for index, (tid, spent) in enumerate(sorted(after.items()))
    }
    return {"cpu_ms_per_s": mean_ci(per_window).as_dict(), "by_thread_ms_per_s": threads}


def _config(workdir: Path, ports: dict[str, int]) -> Path:
    config = workdir / "fanout.toml"
    config.write_text(
        "\n".join(
            [
                "[backends.mongo]",
                'kind = "mongo"',
                f'uri = "mongodb://127.0.0.1:{ports["mongo"]}"',
                'database = "apm"',
                "[backends.alerts]",
                'kind = "http"',
                f'url = "http://127.0.0.1:{ports["alerts"]}"',
                "[backends.metrics]",
                'kind = "http"',
                f'url = "http://127.0.0.1:{ports["metrics"]}"',
            ]
        )
        + "\n"
    )
    return config


def idle_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the manual's performance page shows for ``results``."""
    rows = []
    for name, limit in (("as shipped", GOAL_MS_PER_S), ("hub monitor off", None)):
        figures = results[name]
        estimate = Estimate(**figures["cpu_ms_per_s"])
        text = f"one idle fanout serve, {name}, CPU"
        goal = (
            value_goal("idle", text, estimate, "ms/s", limit)
            if limit is not None
            else info_row("idle", text + " (ms/s)", f"{estimate.value:.2f}")
        )
        rows.append(goal.as_dict())
        for thread, ms in figures["by_thread_ms_per_s"].items():
            rows.append(info_row("idle", f"  {name}: {thread} (ms/s)", f"{ms:.2f}").as_dict())
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--windows", type=int, default=6)
    args = parser.parse_args(argv)
    ports = {name: free_port() for name in ("mongo", "alerts", "metrics")}
    backends = subprocess.Popen(
        [
            *FANOUT,
            "backends",
            "--mongo-port",
            str(ports["mongo"]),
            "--alerts-port",
            str(ports["alerts"]),
            "--metrics-port",
            str(ports["metrics"]),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, Any] = {"machine": machine_facts(sys.argv), "seconds": args.seconds}
    try:
        _wait_for_ports(ports)
        with tempfile.TemporaryDirectory(prefix="fanout-idle-") as work:
            config = _config(Path(work), ports)
            results["as shipped"] = measure(config, {}, args.seconds, args.windows)
            results["hub monitor off"] = measure(
                config, {"FANOUT_SERVER_HUB_BLOCK_THRESHOLD_MS": "0"}, args.seconds, args.windows
            )
    finally:
        stop_process(backends, timeout_s=10)
    results["goals"] = idle_goals(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
