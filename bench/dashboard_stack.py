"""The dashboard bench's stack: the seeded engine, ``fanout serve`` instances, and what
each costs (:mod:`bench.dashboard` runs the viewers)."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pymongo
import requests

from lookups.mongo import ensure_indexes
from service.client import AppStatsClient
from service.samples.mongo_server import free_port, stop_process

__all__ = [
    "APPS",
    "DAY_MS",
    "HOUR_MS",
    "Instance",
    "database_cpu_s",
    "one_aggregation_ms",
    "seed",
    "series_sum",
    "settle",
    "window_now",
]

HOUR_MS, DAY_MS = 3_600_000, 86_400_000
APPS = [f"app{i}" for i in range(10)]
FANOUT = [str(Path(sys.executable).parent / "fanout")]


def window_now() -> tuple[int, int]:
    """The last 24 hours, as a viewer's refresh asks for them now."""
    end_ms = int(time.time() * 1000)
    return end_ms - DAY_MS, end_ms


def seed(uri: str, documents: int, now_ms: int) -> None:
    """``documents`` requests, half as many queries, a quarter as many errors, over the last
    25 hours for :data:`APPS`; the ``(app, ts)`` index."""
    db: pymongo.database.Database[dict[str, Any]] = pymongo.MongoClient(uri).apm
    rng = random.Random(7)
    start_ms = now_ms - DAY_MS - HOUR_MS
    for name, count in (
        ("requests", documents),
        ("queries", documents // 2),
        ("errors", documents // 4),
    ):
        db[name].drop()
        batch = []
        for index in range(count):
            ts = datetime.fromtimestamp((start_ms + rng.randrange(DAY_MS + HOUR_MS)) / 1000, tz=UTC)
            app, pick = APPS[index % len(APPS)], rng.randrange(1_000_000)
            duration = round(rng.expovariate(1 / 120), 1)
            batch.append(
                {
                    "requests": {
                        "app": app,
                        "ts": ts,
                        "url": f"/page/{pick % 60}",
                        "controller": f"Controller{pick % 25}",
                        "duration_ms": duration,
                        "status": 200,
                    },
                    "queries": {
                        "app": app,
                        "ts": ts,
                        "duration_ms": duration,
                        "query": f"SELECT * FROM t{pick % 40} WHERE id = {pick}",
                    },
                    "errors": {"app": app, "ts": ts, "code": 500, "message": f"error {pick % 35}"},
                }[name]
            )
            if len(batch) == 5000:
                db[name].insert_many(batch)
                batch = []
        if batch:
            db[name].insert_many(batch)
    ensure_indexes(db)


class Instance:
    """One ``fanout serve`` with Prometheus metrics, over FerretDB."""

    def __init__(self, uri: str, cache: dict[str, Any], workdir: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        config = workdir / f"fanout-{self.port}.toml"
        lines = [
            "[server]",
            f"port = {self.port}",
            "[backends.mongo]",
            'kind = "mongo"',
            f'uri = "{uri}"',
            'database = "apm"',
            "pool_size = 16",
            "[backends.alerts]",
            'kind = "http"',
            'url = "http://127.0.0.1:9"',
            "[backends.metrics]",
            'kind = "http"',
            'url = "http://127.0.0.1:9"',
            "[fanout]",
            "task_timeout_ms = 8000",
            "request_deadline_ms = 10000",
            "[tracing]",
            "enabled = false",
            "[metrics]",
            'exporter = "prometheus"',
            f"port = {self.metrics_port}",
            "[cache]",
            *(f"{key} = {json.dumps(value)}" for key, value in cache.items()),
        ]
        config.write_text("\n".join(lines) + "\n")
        self.log = (workdir / f"fanout-{self.port}.log").open("w")
        self.process = subprocess.Popen(
            [*FANOUT, "serve", "--config", str(config)], stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while not self._pings():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"fanout serve did not start: see {self.log.name}")
            time.sleep(0.2)

    def _pings(self) -> bool:
        try:
            with AppStatsClient("127.0.0.1", self.port, timeout_ms=1000) as client:
                return bool(client.ping())
        except Exception:
            return False

    def cpu_s(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def scrape(self) -> str:
        """This instance's Prometheus scrape."""
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def stop(self) -> None:
        stop_process(self.process, timeout_s=30)
        self.log.close()


def series_sum(scrape: str, series: str, label: str = "") -> float:
    """The sum of ``series`` in ``scrape`` over the label sets holding ``label``."""
    pattern = rf"^{series}(?:\{{[^}}]*{label}[^}}]*\}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, scrape, re.M))


def database_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the engine's processes, their children (live and ended) included."""
    total = 0.0
    for pid in pids:
        process = psutil.Process(pid)
        times = process.cpu_times()
        total += times.user + times.system + times.children_user + times.children_system
        for child in process.children(recursive=True):
            try:
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
            except psutil.NoSuchProcess:
                pass
    return total


def settle(engine_pids: list[int], limit_s: float = 120.0) -> float:
    """Wait until the engine is idle (autovacuum after the seeding): under 2% of a core
    for 3 s; how long that took."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        before = database_cpu_s(engine_pids)
        time.sleep(3)
        if database_cpu_s(engine_pids) - before < 0.06:
            break
    return round(time.monotonic() - began, 1)


def one_aggregation_ms(uri: str) -> float:
    """How long one uncached aggregation (the urls panel, one app's 24 hours) takes."""
    db: pymongo.database.Database[dict[str, Any]] = pymongo.MongoClient(uri).apm
    start_ms, end_ms = window_now()
    pipeline: list[dict[str, Any]] = [
        {
            "$match": {
                "$and": [
                    {"app": APPS[0]},
                    {"ts": {"$gte": datetime.fromtimestamp(start_ms / 1000, tz=UTC)}},
                    {"ts": {"$lt": datetime.fromtimestamp(end_ms / 1000, tz=UTC)}},
                ]
            }
        },
        {"$group": {"_id": "$url", "count": {"$sum": 1}, "total": {"$sum": "$duration_ms"}}},
        {"$sort": {"count": -1}},
        {"$limit": 10},
    ]
    timings = []
    for _ in range(5):
        began = time.monotonic()
        list(db.requests.aggregate(pipeline))
        timings.append((time.monotonic() - began) * 1000)
    return statistics.median(timings)
