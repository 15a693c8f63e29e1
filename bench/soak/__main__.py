"""``make soak``: a bounded run of valid load, failing backends and garbage connections.

    python -m bench.soak --minutes 10 [--workers 24] [--garbage 4] [--seed 1]

One process, one gevent hub: nx-27017 (a subprocess, seeded) behind a TcpFaultProxy that
adds delay spikes, pauses and resets; alerts and metrics as two FaultyHttpServices that
cycle through every fault mode; a Fanout server in-process (so its greenlets can be
counted); ``--workers`` clients making varied valid calls (and a few invalid ones) with
varied deadlines; ``--garbage`` connectors sending random bytes, truncated frames, slow
drips, oversized length headers and idle connections. It stops by itself and prints what
happened. Exit status 1 if any call hung (no answer within its deadline plus 5 s), the
server stopped answering, or something leaked; 0 otherwise.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import gevent  # noqa: E402
from gevent.event import Event  # noqa: E402

from bench.soak.chaos import cycle_http, cycle_mongo, run_garbage  # noqa: E402
from bench.soak.load import LoadStats, live_greenlets, rss_kib, run_worker, sample_hub_lag  # noqa: E402
from service.app import FanOutService  # noqa: E402
from service.client import AppStatsClient  # noqa: E402
from service.samples import (  # noqa: E402
    SAMPLE_END_MS,
    SAMPLE_START_MS,
    MongoWireServer,
    generate_sample_data,
    seed_mongo_at,
)
from service.samples.faults import FaultyHttpService, TcpFaultProxy  # noqa: E402
from service.settings.config import load_settings  # noqa: E402
from tracing.settings import TracingSettings  # noqa: E402
from tracing.setup import configure_tracing  # noqa: E402

__all__ = ["main"]

_PROGRESS_EVERY_S = 60.0
_SETTLE_S = 15.0


class _LogTally(logging.Handler):
    """Counts log records by level; keeps the first few unexpected (ERROR) ones."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.levels: Counter[str] = Counter()
        self.errors: list[str] = []
        self.first_traceback = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.levels[record.levelname] += 1
        if record.levelno >= logging.ERROR and len(self.errors) < 10:
            error = record.exc_info[1] if record.exc_info else None
            cause = f" ({type(error).__name__}: {error})" if error is not None else ""
            self.errors.append(f"{record.name}: {record.getMessage()}{cause}"[:300])
            if len(self.errors) == 1 and record.exc_info:
                self.first_traceback = logging.Formatter().formatException(record.exc_info)


class _Rig:
    """The backends and the server of one soak run."""

    def __init__(
        self,
        mongo: MongoWireServer,
        proxy: TcpFaultProxy,
        alerts: FaultyHttpService,
        metrics: FaultyHttpService,
        service: FanOutService,
    ) -> None:
        self.mongo, self.proxy, self.alerts, self.metrics = mongo, proxy, alerts, metrics
        self.service = service

    def greenlets(self) -> tuple[int, int]:
        """(live greenlets other than the fault backends' own, parked task runners)."""
        live, parked = live_greenlets()
        return live - sum(len(s.greenlets) for s in (self.proxy, self.alerts, self.metrics)), parked

    def healthy_call(self) -> bool:
        """The server answers ping and a full call with every panel OK."""
        try:
            with AppStatsClient(*self.service.address, timeout_ms=5000) as client:
                response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                return client.ping() == "pong" and all(o.status == 0 for o in response.outcomes)
        except Exception:  # any failure here means: not healthy
            return False


def _settle(rig: _Rig, target: int) -> tuple[int, int]:
    """Wait (bounded) for the live greenlets to come back down to ``target``; the counts."""
    ends = time.monotonic() + _SETTLE_S
    counts = rig.greenlets()
    while counts[0] > target and time.monotonic() < ends:
        gevent.sleep(0.2)
        counts = rig.greenlets()
    return counts


def _run(
    rig: _Rig,
    args: argparse.Namespace,
    stats: LoadStats,
    chaos: Counter[str],
    garbage: Counter[str],
) -> None:
    rng = random.Random(args.seed)
    stop = Event()
    address = rig.service.address
    greenlets = [
        gevent.spawn(cycle_http, "alerts", rig.alerts, random.Random(rng.random()), stop, chaos),
        gevent.spawn(cycle_http, "metrics", rig.metrics, random.Random(rng.random()), stop, chaos),
        gevent.spawn(cycle_mongo, rig.proxy, random.Random(rng.random()), stop, chaos),
    ]
    greenlets += [
        gevent.spawn(run_garbage, address, random.Random(rng.random()), stop, garbage)
        for _ in range(args.garbage)
    ]
    greenlets += [
        gevent.spawn(run_worker, address, random.Random(rng.random()), stop, stats)
        for _ in range(args.workers)
    ]
    greenlets.append(gevent.spawn(sample_hub_lag, stop, stats.hub_lag_ms))
    started = time.monotonic()
    ends = started + args.minutes * 60.0
    while time.monotonic() < ends and not any(g.dead and g.exception for g in greenlets):
        stop.wait(min(_PROGRESS_EVERY_S, max(ends - time.monotonic(), 0.0)))
        print(
            f"[{time.monotonic() - started:6.0f} s] {stats.progress()} rss={rss_kib() // 1024} MiB "
            f"greenlets={live_greenlets()[0]}",
            flush=True,
        )
    stop.set()
    gevent.joinall(greenlets, timeout=30)
    crashed = [g for g in greenlets if g.dead and g.exception is not None]
    if crashed or not all(g.dead for g in greenlets):
        raise RuntimeError(f"soak greenlets crashed or did not stop: {crashed[:3]}")


def _report(
    args: argparse.Namespace,
    rig: _Rig,
    stats: LoadStats,
    chaos: Counter[str],
    garbage: Counter[str],
    logs: _LogTally,
    before: dict[str, int],
    after: dict[str, int],
    alive: bool,
) -> list[str]:
    fan = rig.service.fanout.stats
    lines = [
        f"soak: {stats.duration_s:.0f} s, {args.workers} workers, {args.garbage} garbage connectors",
        *stats.summary(),
        f"fan-out: started {fan.started}, rejected {fan.rejected}, abandoned {fan.abandoned}, "
        f"killed {fan.killed}; in flight at end {rig.service.fanout.inflight}; "
        f"connections in use at end {rig.service.backends.connections_in_use()}",
        "backend faults injected: " + _counts(chaos),
        "garbage connections: " + _counts(garbage),
        "server log lines: " + (_counts(logs.levels) or "none"),
        f"RSS (this process: server, clients and fault backends): start {before['rss'] // 1024} MiB, "
        f"end {after['rss'] // 1024} MiB",
        f"live greenlets (besides the fault backends' own and parked task runners): "
        f"start {before['greenlets']}, end {after['greenlets']}; parked task runners: "
        f"start {before['parked']}, end {after['parked']}",
        f"server answering at end: {'yes' if alive else 'NO'}",
    ]
    return lines + [f"  unexpected: {line}" for line in logs.errors]


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(counter.items()))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--workers", type=int, default=24, help="concurrent valid callers")
    parser.add_argument("--garbage", type=int, default=4, help="concurrent garbage connectors")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random choice")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs = _LogTally()
    # Failing backends make thousands of WARNING lines: the tally counts them instead.
    logging.getLogger().addHandler(logs)
    logging.getLogger().setLevel(logging.WARNING)
    tracing = configure_tracing(
        TracingSettings(exporter="none", service_name="fanout-soak"), env={}
    )
    data = generate_sample_data()
    stats, chaos, garbage = LoadStats(), Counter[str](), Counter[str]()
    with (
        MongoWireServer() as mongo,
        TcpFaultProxy(("127.0.0.1", mongo.port)) as proxy,
        FaultyHttpService(data) as alerts,
        FaultyHttpService(data) as metrics,
    ):
        seed_mongo_at(mongo.uri, "apm", data)
        settings = load_settings(
            env={},
            overrides={
                "mongo.uri": f"mongodb://127.0.0.1:{proxy.address[1]}",
                "mongo.database": "apm",
                "http.alerts_url": alerts.url,
                "http.metrics_url": metrics.url,
                "server.port": 0,
                "fanout.max_inflight_tasks": 96,
                "fanout.queue_timeout_ms": 50,
                "lookups.errors.required": True,
            },
        )
        service = FanOutService(settings).start()
        rig = _Rig(mongo, proxy, alerts, metrics, service)
        try:
            rig.healthy_call()  # warm: clients connected, pools filled, monitors running
            gevent.sleep(1.0)
            live, parked = rig.greenlets()
            before = {"rss": rss_kib(), "greenlets": live, "parked": parked}
            _run(rig, args, stats, chaos, garbage)
            service.fanout.wait_reapers(timeout_s=_SETTLE_S)
            alive = rig.healthy_call()
            live, parked = _settle(rig, before["greenlets"])
            after = {"rss": rss_kib(), "greenlets": live, "parked": parked}
            leaked = service.fanout.inflight != 0 or any(
                service.backends.connections_in_use().values()
            )
            lines = _report(args, rig, stats, chaos, garbage, logs, before, after, alive)
        finally:
            service.stop()
            tracing.shutdown()
    print("\n".join(lines), flush=True)
    failed = stats.hung > 0 or not alive or leaked
    print(f"result: {'FAIL' if failed else 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
