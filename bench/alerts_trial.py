"""The shipped alerts on a real Prometheus, as an on-call engineer meets them.

``python -m gevent.monkey --module bench.alerts_trial [--outage-s 420] [--after-s 150]
[--burst-s 20] [--quiet-s 240] [--out FILE]`` (``make bench-alerts``)

Debian's ``prometheus`` scrapes a ``fanout serve`` of two workers, with the Deployment's
settings, every second and evaluates ``deploy/monitoring/rules/alerts.rules.yaml`` every
second, with the rules' own ``for:``. Two callers ask about six calls a second over the
sample backends. Then:

1. the MongoDB-wire server is killed under that traffic for ``--outage-s`` and started
   again on its port, and the trial goes on ``--after-s``;
2. a storm of naive callers (trying again 20 ms after each ``Overloaded``) is let loose for
   ``--burst-s``, refused by admission, and the trial goes on ``--quiet-s``.

Each second it reads ``ALERTS`` and prints a line for every change of an alert's state;
at the end, each alert's pending and firing spans, from the trial's start, and the
refusals the burst got. What an operator wants to see: ``FanoutBackendDown`` and
``FanoutCircuitOpen`` firing through the outage and resolving after it, and no page for
the burst once it is over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gevent

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, DemoBackends, seed_mongo_at
from service.samples.mongo_server import MongoWireServer, free_port
from tests.support.prometheus import PrometheusServer
from tracing.context import spawn_in_context

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "monitoring" / "rules" / "alerts.rules.yaml"
ALERTS_QUERY = "ALERTS"


class _Prometheus(PrometheusServer):
    """The shipped rules as they are: their ``for:`` is not shortened."""

    @staticmethod
    def _shortened(path: Path, directory: Path) -> Path:
        copy = directory / path.name
        copy.write_text(path.read_text())
        return copy


def _serve(backends: DemoBackends, ports: dict[str, int]) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FANOUT_SERVER_PORT": str(ports["thrift"]),
        "FANOUT_SERVER_PROBE_PORT": str(ports["probes"]),
        "FANOUT_SERVER_WORKERS": "2",
        "FANOUT_SERVER_LAME_DUCK_MS": "0",
        "FANOUT_METRICS_EXPORTER": "prometheus",
        "FANOUT_METRICS_PORT": str(ports["metrics"]),
        "FANOUT_LOGGING_FORMAT": "json",
        "FANOUT_TRACING_EXPORTER": "none",
        **{
            "FANOUT_" + key.upper().replace(".", "_"): value
            for key, value in backends.settings_overrides().items()
        },
    }
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _caller(port: int, pause_s: float, counts: dict[str, int], name: str) -> None:
    with AppStatsClient("127.0.0.1", port, timeout_ms=5000, caller=name) as client:
        while True:
            try:
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=2000)
                counts["answered"] += 1
            except Exception as exc:
                kind = type(exc).__name__
                counts[kind] = counts.get(kind, 0) + 1
            gevent.sleep(pause_s)


def _storm(port: int, connections: int, counts: dict[str, int]) -> list[gevent.Greenlet]:
    return [spawn_in_context(_caller, port, 0.02, counts, "storm") for _ in range(connections)]


class Timeline:
    """Each alert's state second by second, from the trial's start."""

    def __init__(self, prometheus: PrometheusServer) -> None:
        self.prometheus = prometheus
        self.started = time.monotonic()
        self.states: dict[str, str] = {}
        self.spans: dict[str, list[list[Any]]] = {}
        self.events: list[str] = []

    def look(self, phase: str) -> None:
        now = round(time.monotonic() - self.started)
        seen: dict[str, str] = {}
        for sample in self.prometheus.query(ALERTS_QUERY):
            name, state = sample["metric"]["alertname"], sample["metric"]["alertstate"]
            if seen.get(name) != "firing":
                seen[name] = state
        for name in set(seen) | set(self.states):
            before, after = self.states.get(name, "inactive"), seen.get(name, "inactive")
            if before != after:
                self.events.append(f"{now:5d} s [{phase}] {name}: {before} -> {after}")
                print(self.events[-1], flush=True)
                spans = self.spans.setdefault(name, [])
                if spans and spans[-1][2] is None:
                    spans[-1][2] = now
                if after != "inactive":
                    spans.append([after, now, None])
        self.states = seen

    def watch(self, seconds: float, phase: str) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.look(phase)
            gevent.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steady-s", type=float, default=60)
    parser.add_argument("--outage-s", type=float, default=420)
    parser.add_argument("--after-s", type=float, default=150)
    parser.add_argument("--burst-s", type=float, default=20)
    parser.add_argument("--burst-connections", type=int, default=300)
    parser.add_argument("--quiet-s", type=float, default=240)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    ports = {name: free_port() for name in ("thrift", "probes", "metrics", "mongo")}
    backends = DemoBackends(mongo_port=ports["mongo"]).start()
    server = _serve(backends, ports)
    prometheus = _Prometheus(f"127.0.0.1:{ports['metrics']}", [RULES])
    counts: dict[str, int] = {"answered": 0}
    storm_counts: dict[str, int] = {"answered": 0}
    restarted: MongoWireServer | None = None
    try:
        timeline = Timeline(prometheus)
        callers = [
            spawn_in_context(_caller, ports["thrift"], 0.33, counts, "web") for _ in range(2)
        ]
        timeline.watch(args.steady_s, "steady")
        backends.mongo.kill()
        timeline.watch(args.outage_s, "MongoDB killed")
        restarted = MongoWireServer(port=ports["mongo"]).start()
        seed_mongo_at(restarted.uri, backends.database, backends.data)
        timeline.watch(args.after_s, "MongoDB back")
        storm = _storm(ports["thrift"], args.burst_connections, storm_counts)
        timeline.watch(args.burst_s, "burst")
        gevent.killall(storm)
        timeline.watch(args.quiet_s, "after the burst")
        gevent.killall(callers)
    finally:
        prometheus.stop()
        server.terminate()
        server.wait(30)
        if restarted is not None:
            restarted.stop()
        backends.stop()
    result = {
        "phases_s": {
            "steady": args.steady_s,
            "outage": args.outage_s,
            "after": args.after_s,
            "burst": args.burst_s,
            "quiet": args.quiet_s,
        },
        "alerts": timeline.spans,
        "events": timeline.events,
        "callers": counts,
        "burst": storm_counts,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
