"""Lookups from outside the package, served by ``fanout serve`` with no edit to Fanout.

The manual's "Add a lookup" example is taken from the page itself (its
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
from tests.support.samples import GENEROUS_BUDGETS

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "add-a-lookup.md"
BUILT_IN = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]


def page_example() -> tuple[str, str]:
    """The Python module and the TOML of the manual's "Add a lookup" page."""
    section = GUIDE.read_text()
    (module,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (config,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    return module, config


def expected_slow_urls(data: SampleData, app: str, min_count: int) -> list[tuple[str, int]]:
    durations: dict[str, list[float]] = defaultdict(list)
    for record in data.requests:
        if record.app == app and SAMPLE_START_MS <= record.ts_ms < SAMPLE_END_MS:
            durations[record.url].append(record.duration_ms)
    ranked = sorted(
        ((url, values) for url, values in durations.items() if len(values) >= min_count),
        key=lambda item: (-sum(item[1]) / len(item[1]), item[0]),
    )
    return [(url, len(values)) for url, values in ranked[:10]]


def call_slow_urls(port: int) -> Any:
    with AppStatsClient("127.0.0.1", port, timeout_ms=10_000) as client:
        return client.panels(), client.get_app_stats(
            "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["slow_urls", "errors"]
        )


def reports_backend(mongo_server: Any) -> dict[str, str]:
    """The plugin's own backend, ``reports``, on the session's MongoDB-wire server."""
    return {
        "FANOUT_BACKENDS_REPORTS_KIND": "mongo",
        "FANOUT_BACKENDS_REPORTS_URI": mongo_server.uri,
        "FANOUT_BACKENDS_REPORTS_DATABASE": "apm",
    }


def test_the_manual_example_runs_through_fanout_serve_as_written(
    serve: Any, http_services: Any, mongo_server: Any, sample_data: SampleData, tmp_path: Path
) -> None:
    module, config = page_example()
    (tmp_path / "slow_urls.py").write_text(module)
    (tmp_path / "fanout.toml").write_text(config)
    # The page's 500 ms budget, over a connection the call opens, ran out on a starved
    # machine; the generous one `serve` gives the built-in panels replaces it (an
    # environment variable beats the file, as for a user).
    server = serve(
        http_services,
        env={
            "PYTHONPATH": str(tmp_path),
            **reports_backend(mongo_server),
            "FANOUT_LOOKUPS_SLOW_URLS_TIMEOUT_MS": str(GENEROUS_BUDGETS["fanout.task_timeout_ms"]),
        },
        args=("--config", str(tmp_path / "fanout.toml")),
    )
    panels, response = call_slow_urls(server.port)
    assert panels == [*BUILT_IN, "slow_urls"]
    assert [(o.name, o.status) for o in response.outcomes] == [("slow_urls", 0), ("errors", 0)]
    entries = response.panels["slow_urls"].top_list.entries
    found = re.search(r"^min_count = (\d+)", config, re.M)
    assert found is not None, config
    min_count = int(found.group(1))
    assert [(e.key, e.count) for e in entries] == expected_slow_urls(sample_data, "shop", min_count)
    # The panel's own key took effect: without it, some of these URLs would rank.
    assert expected_slow_urls(sample_data, "shop", 1) != expected_slow_urls(
        sample_data, "shop", min_count
    )
    assert entries and all(e.mean_ms * e.count == pytest.approx(e.total_ms) for e in entries)
    # Its own backend: a health check and a pool report, without an edit to Fanout.
    with AppStatsClient("127.0.0.1", server.port, timeout_ms=10_000) as client:
        health = {b.name: b.up for b in client.health().backends}
        pools = {p.name: p.size for p in client.pool_stats().pools}
    assert health == {"mongo": True, "alerts": True, "metrics": True, "reports": True}
    assert pools["reports"] == 7 and pools["mongo"] == 31  # pool_size - 1: one for its health check


def test_a_factory_asking_for_a_backend_nobody_configured_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    module, _ = page_example()
    (tmp_path / "slow_urls.py").write_text(module)
    done = subprocess.run(
        [*FANOUT, "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PYTHONPATH": str(tmp_path),
            "FANOUT_LOOKUPS_SLOW_URLS_FACTORY": "slow_urls:build",
            "OTEL_TRACES_EXPORTER": "none",
        },
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lookup 'slow_urls': no backend 'reports'" in done.stderr
    assert "[backends.reports]" in done.stderr


def test_an_installed_entry_point_is_served_without_configuration(
    serve: Any, http_services: Any, mongo_server: Any, tmp_path: Path
) -> None:
    module, _ = page_example()
    (tmp_path / "slow_urls.py").write_text(module)
    dist_info = tmp_path / "acme_panels-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-panels\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[fanout.lookups]\nslow_urls = slow_urls:build\n")
    server = serve(
        http_services, env={"PYTHONPATH": str(tmp_path), **reports_backend(mongo_server)}
    )
    panels, response = call_slow_urls(server.port)
    assert panels == [*BUILT_IN, "slow_urls"]
    assert response.outcomes[0].status == 0 and response.panels["slow_urls"].top_list.entries


@pytest.mark.parametrize(
    "factory,expected",
    [
        ("no_such_module:build", "lookups.slow_urls.factory: cannot import 'no_such_module:build'"),
        ("slow_urls", "lookups.slow_urls.factory: expected 'module:attribute'"),
        ("slow_urls:TOP_N", "lookups.slow_urls.factory: 10 is not callable"),
        ("slow_urls:SlowUrlsLookup.name", "is not callable"),
    ],
)
def test_a_bad_factory_stops_serve_with_a_configuration_error(
    tmp_path: Path, factory: str, expected: str
) -> None:
    module, _ = page_example()
    (tmp_path / "slow_urls.py").write_text(module)
    done = subprocess.run(
        [*FANOUT, "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PYTHONPATH": str(tmp_path),
            "FANOUT_LOOKUPS_SLOW_URLS_FACTORY": factory,
            "OTEL_TRACES_EXPORTER": "none",
        },
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "configuration error" in done.stderr and expected in done.stderr, done.stderr


def test_a_plugins_own_keys_are_validated_like_fanouts(tmp_path: Path, monkeypatch: Any) -> None:
    """The manual's SlowUrlsSettings: its key from the file or env, bounds checked, typos named."""
    from service.settings.config import ConfigError, load_settings

    module, config = page_example()
    (tmp_path / "slow_urls.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    toml = tmp_path / "fanout.toml"
    toml.write_text(config)
    assert load_settings(toml, env={}).plugin_settings["slow_urls"].min_count == 50
    factory = {"FANOUT_LOOKUPS_SLOW_URLS_FACTORY": "slow_urls:build"}
    from_env = load_settings(
        env={
            **factory,
            "FANOUT_LOOKUPS_SLOW_URLS_MIN_COUNT": "7",
            "FANOUT_LOOKUPS_SLOW_URLS_TIMEOUT_MS": "300",
        }
    )
    assert from_env.plugin_settings["slow_urls"].min_count == 7
    assert from_env.lookup("slow_urls").timeout_ms == 300
    with pytest.raises(ConfigError, match="^lookups.slow_urls.min_count: must be an integer >= 1"):
        load_settings(env={**factory, "FANOUT_LOOKUPS_SLOW_URLS_MIN_COUNT": "0"})
    toml.write_text(config.replace("min_count", "min_cout"))
    with pytest.raises(
        ConfigError, match="^lookups.slow_urls.min_cout: unknown key; expected one of min_count"
    ):
        load_settings(toml, env={})
    # A built-in panel declares no keys of its own: one there is still an error naming it.
    toml.write_text("[lookups.errors]\nmin_count = 3\n")
    with pytest.raises(
        ConfigError,
        match="^lookups.errors.min_count: unknown key; expected one of enabled, timeout_ms",
    ):
        load_settings(toml, env={})
    with pytest.raises(ConfigError, match="^FANOUT_LOOKUPS_ERRORS_MIN_CONT: expected"):
        load_settings(env={**factory, "FANOUT_LOOKUPS_ERRORS_MIN_CONT": "3"})
