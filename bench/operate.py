"""Operating Fanout under load: probes and scrapes at overload, reloads under load.

    python -m bench.operate [--workers 2] [--connections 1000] [--seconds 20] [--reloads 5]

A real ``fanout serve`` (``--workers``) with probes and Prometheus metrics on,
over the sample backends (20 ms each), on loopback; the multi-process load
generator (``bench.load``) holds ``--connections`` connections of callers that
do not back off (they ignore ``retry_after_ms``).

1. Overload: for ``--seconds``, a native thread polls ``/healthz`` and
   ``/readyz`` every 0.5 s and scrapes ``/metrics`` every second, each with a
   1 s timeout (Kubernetes' and Prometheus' usual settings); it reports how
   many answered 200 within it, and the slowest answer.
2. Reloads: 32 callers using ``AppStatsClient`` (``bench.operate_callers``),
   and ``--reloads`` SIGHUPs 3 s apart (only with ``--workers`` > 1); it
   reports calls answered, calls failed by kind, and tracebacks logged.

Bounded: it stops by itself, and every process it started is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.load.frames import stats_frame
from bench.load.loadgen import LoadPlan, run_load
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, DemoBackends
from service.samples.mongo_server import free_port

_TIMEOUT_S = 1.0


class Poller(threading.Thread):
    """Polls the probes and the scrape until stopped; keeps each answer's status and time."""

    def __init__(self, probes: int, metrics: int) -> None:
        super().__init__(daemon=True)
        self.urls = {
            "healthz": (f"http://127.0.0.1:{probes}/healthz", 0.5),
            "readyz": (f"http://127.0.0.1:{probes}/readyz", 0.5),
            "metrics": (f"http://127.0.0.1:{metrics}/metrics", 1.0),
        }
        self.answers: dict[str, list[tuple[bool, float]]] = {name: [] for name in self.urls}
        self.stopped = threading.Event()

    def run(self) -> None:
        due = {name: time.monotonic() for name in self.urls}
        while not self.stopped.is_set():
            for name, (url, every_s) in self.urls.items():
                if time.monotonic() >= due[name]:
                    due[name] += every_s
                    self.answers[name].append(_get(url))
            time.sleep(0.02)

    def report(self) -> dict[str, Any]:
        return {
            name: {
                "polls": len(answers),
                "ok_within_1s": sum(ok for ok, _ in answers),
                "slowest_ms": round(max((ms for _, ms in answers), default=0.0), 1),
            }
            for name, answers in self.answers.items()
        }


def _get(url: str) -> tuple[bool, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as answer:
            answer.read()
            ok = answer.status == 200
    except (urllib.error.URLError, OSError):
        ok = False
    elapsed_ms = (time.monotonic() - started) * 1000.0
    return ok and elapsed_ms <= _TIMEOUT_S * 1000.0, elapsed_ms


def _start_server(
    backends: DemoBackends, workers: int, log: Path
) -> tuple[subprocess.Popen[Any], dict[str, int]]:
    ports = {"thrift": free_port(), "probes": free_port(), "metrics": free_port()}
    keys = {
        **backends.settings_overrides(),
        "server.port": ports["thrift"],
        "server.workers": workers,
        "server.probe_port": ports["probes"],
        "server.max_connections": 4000,
        "metrics.exporter": "prometheus",
        "metrics.port": ports["metrics"],
        "tracing.exporter": "none",
    }
    env = {
        **os.environ,
        **{"FANOUT_" + k.replace(".", "_").upper(): str(v) for k, v in keys.items()},
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert "serving on" in (server.stdout.readline() if server.stdout else ""), log.read_text()[
        -2000:
    ]
    deadline = time.monotonic() + 30
    # /healthz, not /readyz: before readiness ignored backends, a slow check could hold it.
    while not _get(f"http://127.0.0.1:{ports['probes']}/healthz")[0]:
        assert time.monotonic() < deadline, "no answer on /healthz within 30 s"
        time.sleep(0.2)
    time.sleep(1.0)  # every worker of a group serving
    return server, ports


def _plan(port: int, connections: int, seconds: float, backing_off: bool) -> LoadPlan:
    frame = stats_frame("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=1000)
    return LoadPlan(
        address=("127.0.0.1", port),
        method="get_app_stats",
        frames=(frame,),
        connections=connections,
        processes=2,
        warmup_s=1.0,
        window_s=seconds,
        reps=1,
        honour_retry_after=backing_off,
        call_timeout_s=5.0,
    )


def _failures(result: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for failures in [
        *(w.failures for w in result.windows),
        result.connect_failures,
        result.outside_failures,
    ]:
        for kind, count in failures.items():
            total[kind] = total.get(kind, 0) + count
    return total


def overload(backends: DemoBackends, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    server, ports = _start_server(backends, args.workers, workdir / "overload.log")
    poller = Poller(ports["probes"], ports["metrics"])
    try:
        poller.start()
        result = run_load(_plan(ports["thrift"], args.connections, args.seconds, backing_off=False))
        memory = _memory(server.pid)
    finally:
        poller.stopped.set()
        poller.join()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    window = result.windows[0]
    return {
        "probes_and_scrapes": poller.report(),
        "replies_ok": sum(window.ok),
        "failures": _failures(result),
        "connected": result.connected,
        "memory_after_overload": memory,
    }


def _memory(master: int) -> dict[str, float]:
    """RSS and PSS (shared pages split between the processes) of the master and its workers,
    in MiB: what a pod's memory request must cover."""
    import psutil

    totals = {"rss_mib": 0.0, "pss_mib": 0.0}
    for process in [psutil.Process(master), *psutil.Process(master).children()]:
        full = process.memory_full_info()
        totals["rss_mib"] += full.rss / 2**20
        totals["pss_mib"] += full.pss / 2**20
    return {key: round(value, 1) for key, value in totals.items()}


def reloads(backends: DemoBackends, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    log = workdir / "reloads.log"
    server, ports = _start_server(backends, args.workers, log)
    seconds = 3.0 * args.reloads + 4.0
    try:
        callers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gevent.monkey",
                "--module",
                "bench.operate_callers",
                str(ports["thrift"]),
                "32",
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(args.reloads):
            time.sleep(3.0)
            server.send_signal(signal.SIGHUP)
        answered, _ = callers.communicate(timeout=seconds + 60)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    text = log.read_text()
    return {
        "reloads": args.reloads,
        "calls": json.loads(answered),
        "tracebacks": text.count("Traceback"),
        "address_in_use": text.count("Address already in use"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reloads", type=int, default=5)
    args = parser.parse_args()
    report: dict[str, Any] = {"workers": args.workers, "connections": args.connections}
    with (
        tempfile.TemporaryDirectory(prefix="fanout-operate-") as workdir,
        DemoBackends(alerts_delay_ms=20, metrics_delay_ms=20) as backends,
    ):
        report["overload"] = overload(backends, args, Path(workdir))
        if args.workers > 1 and args.reloads:
            report["reloads"] = reloads(backends, args, Path(workdir))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
