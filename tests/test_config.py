"""Settings: defaults, precedence (file < env < flags), and errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest

from service.config import ConfigError, Settings, load_settings, pool_warnings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fanout.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_documented_contract() -> None:
    settings = load_settings(env={})
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 9090)
    assert (settings.server.transport, settings.server.protocol) == ("framed", "binary")
    assert settings.server.max_frame_bytes == 1024 * 1024
    assert (settings.fanout.pool_size, settings.fanout.max_inflight_tasks) == (16, 1000)
    assert settings.mongo.database == "apm"
    assert settings.lookup("errors").enabled and not settings.lookup("errors").required
    assert settings.task_timeout_ms("errors") == settings.fanout.task_timeout_ms


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, """
[server]
port = 9100
protocol = "compact"
[fanout]
pool_size = 8
[lookups.errors]
required = true
timeout_ms = 250
""")
    env = {"FANOUT_SERVER_PORT": "9200", "FANOUT_LOOKUPS_ERRORS_TIMEOUT_MS": "300",
           "FANOUT_LOOKUPS_LATENCY_ENABLED": "false", "PATH": "/bin"}
    settings = load_settings(path, env=env, overrides={"server.port": 9300, "server.host": None})
    assert settings.server.port == 9300            # flag beats env beats file
    assert settings.server.protocol == "compact"   # file beats default
    assert settings.fanout.pool_size == 8
    assert settings.lookup("errors").required and settings.task_timeout_ms("errors") == 300
    assert settings.lookup("latency").enabled is False
    assert settings.server.host == "127.0.0.1"     # a None flag is ignored


@pytest.mark.parametrize("text, env, key", [
    ("[fanout]\npool_size = 0\n", {}, "fanout.pool_size"),
    ("[fanout]\npool_size = 'many'\n", {}, "fanout.pool_size"),
    ("[server]\ntransport = 'http'\n", {}, "server.transport"),
    ("[server]\nport = 70000\n", {}, "server.port"),
    ("[server]\nprot = 'binary'\n", {}, "server.prot"),
    ("[http]\nalerts_url = 'ftp://x'\n", {}, "http.alerts_url"),
    ("[lookups.errors]\nrequired = 'perhaps'\n", {}, "lookups.errors.required"),
    ("[nosuch]\nx = 1\n", {}, "nosuch"),
    ("", {"FANOUT_FANOUT_QUEUE_TIMEOUT_MS": "-5"}, "fanout.queue_timeout_ms"),
    ("", {"FANOUT_MONGO_MAX_POOL_SIZE": "1.5"}, "mongo.max_pool_size"),
    ("", {"FANOUT_SERVER_PROTT": "binary"}, "server.prott"),
    ("", {"FANOUT_TRACING_SAMPLE_RATIO": "2"}, "tracing.sample_ratio"),
])
def test_bad_values_fail_naming_the_key(tmp_path: Path, text: str, env: dict, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text), env=env)
    assert str(caught.value).startswith(key)


def test_kubernetes_service_links_are_ignored_but_a_misspelled_key_is_not(tmp_path: Path) -> None:
    links = {"FANOUT_SERVICE_HOST": "10.0.0.7", "FANOUT_SERVICE_PORT": "9090",
             "FANOUT_PORT": "tcp://10.0.0.7:9090", "FANOUT_PORT_9090_TCP_ADDR": "10.0.0.7"}
    settings = load_settings(env={**links, "FANOUT_SERVER_PORT": "9300"})
    assert settings.server.port == 9300
    with pytest.raises(ConfigError, match="server.prott"):
        load_settings(env={**links, "FANOUT_SERVER_PROTT": "x"})
    with pytest.raises(ConfigError, match="service"):
        load_settings(write(tmp_path, "[service]\nhost = 'x'\n"), env={})


def test_unreadable_and_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "[server\n"), env={})


def test_settings_are_immutable() -> None:
    settings = load_settings(env={})
    with pytest.raises(AttributeError):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.lookups["x"] = None  # type: ignore[index]


def test_pool_warnings_name_the_mismatch() -> None:
    assert pool_warnings(Settings()) == []
    settings = load_settings(env={"FANOUT_HTTP_POOL_MAXSIZE": "4", "FANOUT_MONGO_MAX_POOL_SIZE": "2"})
    warnings = pool_warnings(settings)
    assert any(w.startswith("http.pool_maxsize (4) < fanout.pool_size (16)") for w in warnings)
    assert any(w.startswith("mongo.max_pool_size (2) < fanout.pool_size (16)") for w in warnings)


def test_hardening_defaults_are_bounded_and_safe() -> None:
    server = load_settings(env={}).server
    assert server.host == "127.0.0.1"
    assert (server.tls_cert_file, server.tls_key_file) == ("", "")
    assert 0 < server.max_string_bytes <= server.max_frame_bytes
    assert server.max_container_items > 0 and server.max_nesting_depth > 0
    assert server.frame_timeout_ms <= server.idle_timeout_ms
    assert server.workers == 1


@pytest.mark.parametrize("overrides, message", [
    ({"server.tls_cert_file": "cert.pem"}, "set both or neither"),
    ({"server.tls_key_file": "key.pem"}, "set both or neither"),
    ({"server.max_frame_bytes": 1024, "server.max_string_bytes": 2048},
     "server.max_string_bytes: must be at most server.max_frame_bytes"),
    ({"server.workers": 0}, "server.workers: must be an integer between 1 and 64"),
    ({"server.workers": 65}, "server.workers"),
    ({"server.max_frame_bytes": 10}, "server.max_frame_bytes"),
    ({"server.hub_block_threshold_ms": -1}, "server.hub_block_threshold_ms"),
])
def test_hardening_settings_are_checked_together(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env={}, overrides=overrides)


def test_zero_turns_the_hub_monitor_and_drain_wait_off() -> None:
    settings = load_settings(env={}, overrides={"server.hub_block_threshold_ms": 0,
                                                "server.drain_timeout_ms": 0})
    assert settings.server.hub_block_threshold_ms == 0 and settings.server.drain_timeout_ms == 0


@pytest.mark.parametrize(("quota", "period", "cores"), [
    ("200000", "100000", 2), ("150000", "100000", 2), ("50000", "100000", 1),
    ("max", "100000", None), ("-1", "100000", None), ("100000", "0", None), ("", "", None)])
def test_a_cgroup_cpu_quota_is_counted_in_whole_cores(quota: str, period: str,
                                                      cores: Optional[int]) -> None:
    from service.workers.process import quota_cores

    assert quota_cores(quota, period) == cores


def test_workers_auto_is_one_per_usable_core(tmp_path) -> None:
    from service.workers.process import usable_cores

    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    path = tmp_path / "fanout.toml"
    path.write_text('[server]\nworkers = "auto"\n')
    assert load_settings(path, env={}).server.workers == cores
    assert load_settings(env={"FANOUT_SERVER_WORKERS": "AUTO"}).server.workers == cores
    assert load_settings(env={}, overrides={"server.workers": "auto"}).server.workers == cores
    assert load_settings(env={}, overrides={"server.workers": "2"}).server.workers == 2
    with pytest.raises(ConfigError, match="server.workers: must be an integer"):
        load_settings(env={}, overrides={"server.workers": "many"})
    with pytest.raises(ConfigError, match="fanout.pool_size: must be an integer"):
        load_settings(env={"FANOUT_FANOUT_POOL_SIZE": "auto"})   # only where "auto" means something


def test_an_http_panel_budget_over_the_read_timeout_is_warned() -> None:
    from lookups.clients import BackendClients
    from lookups.registry import default_registry
    from service.app import read_timeout_warnings

    settings = load_settings(overrides={"lookups.alerts.timeout_ms": 1500,
                                        "lookups.errors.timeout_ms": 1500})
    clients = BackendClients(settings.mongo, settings.http, settings.lookups)
    try:
        lookups = default_registry().build(clients).values()
        assert read_timeout_warnings(load_settings(), lookups) == []
        (warning,) = read_timeout_warnings(settings, lookups)  # errors is a MongoDB panel
    finally:
        clients.close()
    assert warning.startswith("lookups.alerts.timeout_ms (1500) > http.read_timeout_ms (1000)")
