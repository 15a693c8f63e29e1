"""A real Prometheus (Debian's ``prometheus``) scraping one target every second and
evaluating the shipped rule files, in a directory of its own on a free loopback port.

Each alert's ``for:`` is shortened to :data:`FOR_IN_TESTS` in the copy it loads: the
expressions are the shipped ones, and ``promtool test rules`` covers the real ``for:``.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import requests
import yaml

from service.samples.mongo_server import free_port, stop_process
from tests.support.sockets import wait_for
from tests.support.toolchains import require

__all__ = ["PrometheusServer", "FOR_IN_TESTS"]

FOR_IN_TESTS = "4s"


class PrometheusServer:
    """``prometheus`` scraping ``target`` (host:port) as job ``fanout`` with ``rule_files``."""

    def __init__(self, target: str, rule_files: Iterable[Path]) -> None:
        require("prometheus")
        self._dir = tempfile.TemporaryDirectory(prefix="fanout-prometheus-")
        directory = Path(self._dir.name)
        rules = [self._shortened(path, directory) for path in rule_files]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in rules],
            "scrape_configs": [{"job_name": "fanout", "static_configs": [{"targets": [target]}]}],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(self._ready, 30, "prometheus ready")

    @staticmethod
    def _shortened(path: Path, directory: Path) -> Path:
        groups = yaml.safe_load(path.read_text())
        for group in groups["groups"]:
            group.pop("interval", None)  # the global one second
            for rule in group["rules"]:
                if "alert" in rule and "for" in rule:
                    rule["for"] = FOR_IN_TESTS
        copy = directory / path.name
        copy.write_text(yaml.safe_dump(groups))
        return copy

    def _ready(self) -> bool:
        assert self.process.poll() is None, (
            self.process.stderr.read() if self.process.stderr else ""
        )
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant query's result (a vector's samples); raises on a query that fails."""
        answer = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = answer.json()
        assert body.get("status") == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def alerts(self, state: str = "firing") -> list[dict[str, Any]]:
        """The alerts in ``state`` (firing or pending) now."""
        body = requests.get(f"{self.url}/api/v1/alerts", timeout=10).json()
        return [alert for alert in body["data"]["alerts"] if alert["state"] == state]

    def targets_up(self) -> bool:
        return bool(self.query('up{job="fanout"} == 1'))

    def stop(self) -> None:
        stop_process(self.process, timeout_s=10)
        self._dir.cleanup()
