"""A ``fanout serve --workers 2`` for ``bench.group``, and what is read off it: its workers,
its probes, its merged scrape, its memory."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from service.samples import DemoBackends
from service.samples.mongo_server import free_port

__all__ = ["Group", "wait", "calls_by_worker", "group_memory", "workers_in"]


class Group:
    """A ``fanout serve --workers 2`` with probes and metrics on, its log in ``workdir``."""

    def __init__(self, backends: DemoBackends, workdir: Path, name: str, **keys: Any) -> None:
        self.ports = {"thrift": free_port(), "probes": free_port(), "metrics": free_port()}
        settings = {
            **backends.settings_overrides(),
            "server.port": self.ports["thrift"],
            "server.workers": 2,
            "server.probe_port": self.ports["probes"],
            "metrics.exporter": "prometheus",
            "metrics.port": self.ports["metrics"],
            "tracing.exporter": "none",
            **keys,
        }
        env = {
            **os.environ,
            **{"FANOUT_" + k.replace(".", "_").upper(): str(v) for k, v in settings.items()},
        }
        self.log = workdir / f"{name}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        line = self.process.stdout.readline() if self.process.stdout else ""
        assert "serving on" in line, self.log.read_text()[-2000:]

    def workers(self) -> list[int]:
        return sorted(child.pid for child in psutil.Process(self.process.pid).children())

    def probe(self) -> dict[str, Any]:
        return requests.get(f"http://127.0.0.1:{self.ports['probes']}/healthz", timeout=5).json()

    def all_serving(self) -> bool:
        try:
            return set(self.probe()["workers"].values()) == {"serving"}
        except (requests.RequestException, ValueError):
            return False

    def scrape(self, session: requests.Session | None = None) -> str:
        return (
            (session or requests)
            .get(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=5)
            .text
        )

    def reload_and_wait(self) -> None:
        before = set(self.workers())
        self.process.send_signal(signal.SIGHUP)
        wait(
            lambda: not before & set(self.workers()) and self.all_serving(), 30, "a new generation"
        )

    def kill(self, victim: int) -> None:
        """``kill -9`` the worker ``victim``; return once its replacement serves."""
        os.kill(victim, signal.SIGKILL)
        wait(lambda: victim not in self.workers() and self.all_serving(), 30, "the replacement")

    def stop(self) -> dict[str, int]:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        text = self.log.read_text()
        return {"tracebacks": text.count("Traceback"), "exit_code": self.process.returncode}


def wait(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        gevent.sleep(0.05)
    return result


def calls_by_worker(scrape: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if (
                sample.name == "rpc_server_call_duration_seconds_count"
                and sample.labels.get("rpc_method") == "AppStats/get_app_stats"
            ):
                worker = sample.labels["worker"]
                counts[worker] = counts.get(worker, 0.0) + sample.value
    return counts


def group_memory(group: Group) -> dict[str, float]:
    """RSS and PSS (shared pages split between processes) of the master and its workers, MiB."""
    rss = pss = 0.0
    for pid in [group.process.pid, *group.workers()]:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        rss += _kib(r"^Rss:\s+(\d+)", rollup) / 1024
        pss += _kib(r"^Pss:\s+(\d+)", rollup) / 1024
    return {"rss_mib": round(rss, 1), "pss_mib": round(pss, 1)}


def _kib(pattern: str, rollup: str) -> int:
    found = re.search(pattern, rollup, re.M)
    assert found is not None, rollup
    return int(found.group(1))


def workers_in(scrape: str) -> set[str]:
    return {
        s.labels["worker"]
        for family in text_string_to_metric_families(scrape)
        if family.name == "fanout_admission_limit"
        for s in family.samples
    }
