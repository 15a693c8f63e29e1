"""Lookups from outside the package, served by ``fanout serve`` with no edit to Fanout.

The README's "Adding a lookup" example is taken from the README itself (its
Python module and its TOML), so the documentation is what runs.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData
from tests.support.processes import FANOUT

README = Path(__file__).resolve().parent.parent / "README.md"
BUILT_IN = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]


def readme_example() -> tuple[str, str]:
    """The Python module and the TOML of the README's "Adding a lookup" section."""
    section = README.read_text().split("## Adding a lookup", 1)[1].split("\n## ", 1)[0]
    (module,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (config,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    return module, config


def expected_slow_urls(data: SampleData, app: str) -> list[tuple[str, int]]:
    durations: dict[str, list[float]] = defaultdict(list)
    for record in data.requests:
        if record.app == app and SAMPLE_START_MS <= record.ts_ms < SAMPLE_END_MS:
            durations[record.url].append(record.duration_ms)
    ranked = sorted(durations.items(), key=lambda item: (-sum(item[1]) / len(item[1]), item[0]))
    return [(url, len(values)) for url, values in ranked[:10]]


def call_slow_urls(port: int) -> Any:
    with AppStatsClient("127.0.0.1", port, timeout_ms=10_000) as client:
        return client.panels(), client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS,
                                                     ["slow_urls", "errors"])


def reports_backend(mongo_server: Any) -> dict[str, str]:
    """The plugin's own backend, ``reports``, on the session's MongoDB-wire server."""
    return {"FANOUT_BACKENDS_REPORTS_KIND": "mongo", "FANOUT_BACKENDS_REPORTS_URI": mongo_server.uri,
            "FANOUT_BACKENDS_REPORTS_DATABASE": "apm"}


def test_the_readme_example_runs_through_fanout_serve_as_written(serve: Any, http_services: Any,
                                                               mongo_server: Any,
                                                               sample_data: SampleData,
                                                               tmp_path: Path) -> None:
    module, config = readme_example()
    (tmp_path / "slow_urls.py").write_text(module)
    (tmp_path / "fanout.toml").write_text(config)
    server = serve(http_services, env={"PYTHONPATH": str(tmp_path), **reports_backend(mongo_server)},
                   args=("--config", str(tmp_path / "fanout.toml")))
    panels, response = call_slow_urls(server.port)
    assert panels == [*BUILT_IN, "slow_urls"]
    assert [(o.name, o.status) for o in response.outcomes] == [("slow_urls", 0), ("errors", 0)]
    entries = response.panels["slow_urls"].top_list.entries
    assert [(e.key, e.count) for e in entries] == expected_slow_urls(sample_data, "shop")
    assert entries and all(e.mean_ms * e.count == pytest.approx(e.total_ms) for e in entries)
    # Its own backend: a health check and a pool report, without an edit to Fanout.
    with AppStatsClient("127.0.0.1", server.port, timeout_ms=10_000) as client:
        health = {b.name: b.up for b in client.health().backends}
        pools = {p.name: p.size for p in client.pool_stats().pools}
    assert health == {"mongo": True, "alerts": True, "metrics": True, "reports": True}
    assert pools["reports"] == 7 and pools["mongo"] == 31   # pool_size - 1: one for its health check


def test_a_factory_asking_for_a_backend_nobody_configured_is_a_configuration_error(
        tmp_path: Path) -> None:
    module, _ = readme_example()
    (tmp_path / "slow_urls.py").write_text(module)
    done = subprocess.run([*FANOUT, "serve", "--port", "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path),
                                           "FANOUT_LOOKUPS_SLOW_URLS_FACTORY": "slow_urls:build",
                                           "OTEL_TRACES_EXPORTER": "none"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lookup 'slow_urls': no backend 'reports'" in done.stderr
    assert "[backends.reports]" in done.stderr


def test_an_installed_entry_point_is_served_without_configuration(serve: Any, http_services: Any,
                                                                  mongo_server: Any,
                                                                  tmp_path: Path) -> None:
    module, _ = readme_example()
    (tmp_path / "slow_urls.py").write_text(module)
    dist_info = tmp_path / "acme_panels-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-panels\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[fanout.lookups]\nslow_urls = slow_urls:build\n")
    server = serve(http_services, env={"PYTHONPATH": str(tmp_path), **reports_backend(mongo_server)})
    panels, response = call_slow_urls(server.port)
    assert panels == [*BUILT_IN, "slow_urls"]
    assert response.outcomes[0].status == 0 and response.panels["slow_urls"].top_list.entries


@pytest.mark.parametrize("factory,expected", [
    ("no_such_module:build", "lookups.slow_urls.factory: cannot import 'no_such_module:build'"),
    ("slow_urls", "lookups.slow_urls.factory: expected 'module:attribute'"),
    ("slow_urls:TOP_N", "lookups.slow_urls.factory: 10 is not callable"),
    ("slow_urls:SlowUrlsLookup.name", "is not callable"),
])
def test_a_bad_factory_stops_serve_with_a_configuration_error(tmp_path: Path, factory: str,
                                                              expected: str) -> None:
    module, _ = readme_example()
    (tmp_path / "slow_urls.py").write_text(module)
    done = subprocess.run([*FANOUT, "serve", "--port", "0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path),
                                           "FANOUT_LOOKUPS_SLOW_URLS_FACTORY": factory,
                                           "OTEL_TRACES_EXPORTER": "none"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "configuration error" in done.stderr and expected in done.stderr, done.stderr
