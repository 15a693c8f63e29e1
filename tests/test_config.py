"""Settings: defaults, precedence (file < env < flags), and errors that name the key."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from service.settings.checks import pool_warnings
from service.settings.config import ConfigError, Settings, load_settings


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
    path = write(
        tmp_path,
        """
[server]
port = 9100
protocol = "compact"
[fanout]
pool_size = 8
[lookups.errors]
required = true
timeout_ms = 250
""",
    )
    env = {
        "FANOUT_SERVER_PORT": "9200",
        "FANOUT_LOOKUPS_ERRORS_TIMEOUT_MS": "300",
        "FANOUT_LOOKUPS_LATENCY_ENABLED": "false",
        "PATH": "/bin",
    }
    settings = load_settings(path, env=env, overrides={"server.port": 9300, "server.host": None})
    assert settings.server.port == 9300  # flag beats env beats file
    assert settings.server.protocol == "compact"  # file beats default
    assert settings.fanout.pool_size == 8
    assert settings.lookup("errors").required and settings.task_timeout_ms("errors") == 300
    assert settings.lookup("latency").enabled is False
    assert settings.server.host == "127.0.0.1"  # a None flag is ignored


@pytest.mark.parametrize(
    "text, env, key",
    [
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
    ],
)
def test_bad_values_fail_naming_the_key(
    tmp_path: Path, text: str, env: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text), env=env)
    assert str(caught.value).startswith(key)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("sever", "sever: unknown section; did you mean [server]?"),
        ("backend", "backend: unknown section; did you mean [backends]?"),
        ("zzz", "zzz: unknown section; expected one of "),
    ],
)
def test_an_unknown_section_is_refused_with_the_nearest_known_one(
    tmp_path: Path, section: str, message: str
) -> None:
    config = tmp_path / "fanout.toml"
    config.write_text(f"[{section}]\nport = 9090\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config, env={})
    assert str(refused.value).startswith(message), refused.value


def test_kubernetes_service_links_are_ignored_but_a_misspelled_key_is_not(tmp_path: Path) -> None:
    links = {
        "FANOUT_SERVICE_HOST": "10.0.0.7",
        "FANOUT_SERVICE_PORT": "9090",
        "FANOUT_PORT": "tcp://10.0.0.7:9090",
        "FANOUT_PORT_9090_TCP_ADDR": "10.0.0.7",
    }
    settings = load_settings(env={**links, "FANOUT_SERVER_PORT": "9300"})
    assert settings.server.port == 9300
    with pytest.raises(ConfigError, match="server.prott"):
        load_settings(env={**links, "FANOUT_SERVER_PROTT": "x"})
    with pytest.raises(ConfigError, match="service"):
        load_settings(write(tmp_path, "[service]\nhost = 'x'\n"), env={})


def test_a_table_for_no_lookup_is_an_error_naming_it_and_the_known_ones(tmp_path: Path) -> None:
    """Its keys would apply to nothing: a misspelt panel is refused, not warned about."""
    from service.app import FanOutService

    settings = load_settings(write(tmp_path, "[lookups.erors]\ntimeout_ms = 500\n"), env={})
    with pytest.raises(ConfigError, match=r"lookups\.erors: no such lookup; known: .*errors"):
        FanOutService(settings)


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
    settings = load_settings(
        env={"FANOUT_HTTP_POOL_MAXSIZE": "4", "FANOUT_MONGO_MAX_POOL_SIZE": "2"}
    )
    warnings = pool_warnings(settings)
    assert any(
        w.startswith(
            "http.pool_maxsize (4) < fanout.pool_size (16): parallel lookups of alerts and metrics"
        )
        for w in warnings
    ), warnings
    assert any(w.startswith("mongo.max_pool_size (2) < fanout.pool_size (16)") for w in warnings)
    # [http] is one warning for its two backends; then one per deprecated section written.
    assert len(warnings) == 4 and [w.split(" ")[0] for w in warnings[2:]] == ["[mongo]", "[http]"]
    assert 'write [backends.mongo] (kind = "mongo") instead' in warnings[2]
    tables = load_settings(
        env={"FANOUT_BACKENDS_JOBS_KIND": "http", "FANOUT_BACKENDS_JOBS_POOL_SIZE": "3"}
    )
    assert [w for w in pool_warnings(tables) if w.startswith("backends.jobs.pool_size (3)")]
    assert not [w for w in pool_warnings(tables) if "deprecated" in w]


def test_hardening_defaults_are_bounded_and_safe() -> None:
    server = load_settings(env={}).server
    assert server.host == "127.0.0.1"
    assert (server.tls_cert_file, server.tls_key_file) == ("", "")
    assert 0 < server.max_string_bytes <= server.max_frame_bytes
    assert server.max_container_items > 0 and server.max_nesting_depth > 0
    assert server.frame_timeout_ms <= server.idle_timeout_ms
    assert server.workers == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"server.tls_cert_file": "cert.pem"}, "set both or neither"),
        ({"server.tls_key_file": "key.pem"}, "set both or neither"),
        (
            {"server.max_frame_bytes": 1024, "server.max_string_bytes": 2048},
            "server.max_string_bytes: must be at most server.max_frame_bytes",
        ),
        ({"server.workers": 0}, "server.workers: must be an integer between 1 and 64"),
        ({"server.workers": 65}, "server.workers"),
        ({"server.max_frame_bytes": 10}, "server.max_frame_bytes"),
        ({"server.hub_block_threshold_ms": -1}, "server.hub_block_threshold_ms"),
    ],
)
def test_hardening_settings_are_checked_together(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env={}, overrides=overrides)


def test_zero_turns_the_hub_monitor_and_drain_wait_off() -> None:
    settings = load_settings(
        env={}, overrides={"server.hub_block_threshold_ms": 0, "server.drain_timeout_ms": 0}
    )
    assert settings.server.hub_block_threshold_ms == 0 and settings.server.drain_timeout_ms == 0


@pytest.mark.parametrize(
    ("quota", "period", "cores"),
    [
        ("200000", "100000", 2),
        ("150000", "100000", 2),
        ("50000", "100000", 1),
        ("max", "100000", None),
        ("-1", "100000", None),
        ("100000", "0", None),
        ("", "", None),
    ],
)
def test_a_cgroup_cpu_quota_is_counted_in_whole_cores(
    quota: str, period: str, cores: int | None
) -> None:
    from service.settings.cores import quota_cores

    assert quota_cores(quota, period) == cores


def test_workers_auto_is_one_per_usable_core(tmp_path) -> None:
    from service.settings.cores import usable_cores

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
        load_settings(env={"FANOUT_FANOUT_POOL_SIZE": "auto"})  # only where "auto" means something


def test_an_http_panel_budget_over_the_read_timeout_is_warned() -> None:
    from lookups.backends.collection import Backends
    from lookups.registry import default_registry
    from service.app import read_timeout_warnings

    settings = load_settings(
        overrides={"lookups.alerts.timeout_ms": 1500, "lookups.errors.timeout_ms": 1500}
    )
    clients = Backends(settings.backends, settings.lookups)
    try:
        lookups = default_registry().build(clients).values()
        assert read_timeout_warnings(load_settings(), lookups) == []
        (warning,) = read_timeout_warnings(settings, lookups)  # errors is a MongoDB panel
    finally:
        clients.close()
    assert warning.startswith(
        "lookups.alerts.timeout_ms (1500) > read_timeout_ms of backend alerts (1000)"
    )


# --- [backends.<name>] -----------------------------------------------------------------------


def test_backend_tables_by_kind_and_the_aliases_they_replace(tmp_path: Path) -> None:
    from lookups.backends.settings import HttpBackendSettings, MongoBackendSettings

    config = tmp_path / "fanout.toml"
    config.write_text(
        '[mongo]\nuri = "mongodb://old:27017"\n'
        '[http]\nmetrics_url = "http://metrics.old:8082"\npool_maxsize = 20\n'
        '[backends.mongo]\nkind = "mongo"\nuri = "mongodb://new:27017"\npool_size = 12\n'
        '[backends.jobs]\nkind = "http"\nurl = "https://jobs.internal"\n'
    )
    backends = load_settings(config, env={}).backends
    assert list(backends) == ["mongo", "alerts", "metrics", "jobs"]
    assert backends["mongo"] == MongoBackendSettings(
        uri="mongodb://new:27017", pool_size=12
    )  # the table wins
    assert backends["metrics"] == HttpBackendSettings(
        url="http://metrics.old:8082", pool_size=20
    )  # alias
    alerts = backends["alerts"]
    assert isinstance(alerts, HttpBackendSettings)
    assert alerts.url == "http://127.0.0.1:8081" and alerts.pool_size == 20
    assert backends["jobs"] == HttpBackendSettings(url="https://jobs.internal")
    env = {"FANOUT_BACKENDS_JOBS_READ_TIMEOUT_MS": "250", "FANOUT_BACKENDS_JOBS_KIND": "http"}
    jobs = load_settings(env=env).backends["jobs"]
    assert isinstance(jobs, HttpBackendSettings) and jobs.read_timeout_ms == 250


@pytest.mark.parametrize(
    "body, message",
    [
        ({"url": "http://x"}, "backends.jobs.kind: missing; set it to one of 'mongo', 'http'"),
        ({"kind": "redis"}, "backends.jobs.kind: must be one of 'mongo', 'http', got 'redis'"),
        ({"kind": "http", "uri": "mongodb://x"}, "backends.jobs.uri: unknown key"),
        (
            {"kind": "http", "url": "ftp://x"},
            "backends.jobs.url: must start with http:// or https://",
        ),
        ({"kind": "mongo", "pool_size": 0}, "backends.jobs.pool_size: must be an integer >= 1"),
        # A URL's password is never quoted back.
        (
            {"kind": "http", "url": "ftp://jobs:s3cret@x"},
            "backends.jobs.url: must start with http:// or https://, got 'ftp://***@x'",
        ),
        (
            {"kind": "http", "url": "http://jobs:s3cret@x:port/"},
            "backends.jobs.url: not a valid port in 'http://***@x:port/'",
        ),
        ({"kind": "http", "url": "https://:8443/"}, "backends.jobs.url: no host in"),
    ],
)
def test_a_bad_backend_table_is_an_error_naming_the_key(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_settings(
            env={}, overrides={f"backends.jobs.{key}": value for key, value in body.items()}
        )
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize(
    "url, message",
    [
        ("memcached://:s3cret@cache:11211", "cache.url: must start with redis:// or rediss://"),
        ("redis://:s3cret@cache:99999/0", "cache.url: not a valid port in 'redis://***@cache"),
        ("rediss://:s3cret@/0", "cache.url: no host in 'rediss://***@/0'"),
    ],
)
def test_a_bad_cache_url_is_an_error_naming_the_key_and_hiding_its_password(
    url: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        load_settings(env={}, overrides={"cache.enabled": True, "cache.url": url})
    assert "s3cret" not in str(refused.value)


def test_the_manual_shows_every_settings_table_once() -> None:
    """Each table made from the declarations has one place in the manual's pages, where
    the build fills it in (docs/_generate/hooks.py), and shows every section's keys."""
    from service.cli.settings_table import tables

    docs = Path(__file__).resolve().parent.parent / "docs"
    blocks = [
        name
        for page in docs.rglob("*.md")
        for name in re.findall(r"<!-- settings:(\w+) -->", page.read_text())
    ]
    assert sorted(blocks) == sorted(tables()), "each table appears once in the manual"
    for page in docs.rglob("*.md"):
        for name, body in re.findall(
            r"<!-- settings:(\w+) -->(.*?)<!-- /settings:\1 -->", page.read_text(), re.S
        ):
            assert body.strip() == "", f"{page}: table {name} is written by hand, not generated"
    made = "".join(tables().values())
    for section in (
        "server",
        "fanout",
        "admission",
        "lookups.<name>",
        "mongo",
        "http",
        "tracing",
        "metrics",
        "logging",
        "cache",
    ):
        assert f"| `{section}." in made, section


def test_every_section_declares_every_key_with_help_and_integer_bounds() -> None:
    from lookups.backends.settings import BACKEND_KINDS
    from lookups.settings import LookupSettings
    from service.settings.config import _SECTIONS
    from service.settings.declarations import keys_of

    for section in [*_SECTIONS.values(), *BACKEND_KINDS.values(), LookupSettings]:
        keys = keys_of(section)  # raises TypeError for an ill-declared key
        assert keys and all(key.help for key in keys), section
        assert all(key.min is not None for key in keys if key.kind == "int"), section


def test_an_ill_declared_section_is_refused_when_first_read() -> None:
    from dataclasses import dataclass, field

    from service.settings.declarations import keys_of

    @dataclass(frozen=True)
    class NoHelp:
        size: int = field(default=1, metadata={"min": 1})

    @dataclass(frozen=True)
    class NoBound:
        size: int = field(default=1, metadata={"help": "how many"})

    @dataclass(frozen=True)
    class Misspelt:
        size: int = field(default=1, metadata={"help": "how many", "min": 1, "maxx": 3})

    @dataclass(frozen=True)
    class ChoicesOnAnInt:
        size: int = field(default=1, metadata={"help": "how many", "min": 1, "choices": (1,)})

    for section, message in (
        (NoHelp, "needs 'help'"),
        (NoBound, "declares its 'min'"),
        (Misspelt, "got \\['help', 'maxx', 'min'\\]"),
        (ChoicesOnAnInt, "'choices' is for a str"),
    ):
        with pytest.raises(TypeError, match=f"{section.__name__}.size: .*{message}"):
            keys_of(section)


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"FANOUT_BACKENDS_JOBS_KIND": "http", "FANOUT_BACKENDS_JOBS_RETRY_BUDGET_RATIO": "1.5"},
            "backends.jobs.retry_budget_ratio: must be a number between 0.0 and 1.0, got 1.5",
        ),
        ({"FANOUT_ADMISSION_TOLERANCE": "0.5"}, "admission.tolerance: must be a number >= 1.0"),
        (
            {"FANOUT_ADMISSION_MAX_LATENCY_FRACTION": "0"},
            "admission.max_latency_fraction: must be in",
        ),
        (
            {"FANOUT_LOOKUPS_ERRORS_ATTEMPTS": "11"},
            "lookups.errors.attempts: must be an integer between 1 and 10, got 11",
        ),
        ({"FANOUT_METRICS_PORT": "-2"}, "metrics.port: must be an integer between -1 and 65535"),
        ({"FANOUT_SERVER_WORKERS": "sixteen"}, "server.workers: must be an integer, got 'sixteen'"),
    ],
)
def test_declared_bounds_are_enforced_naming_the_key(env: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(env=env)
    assert str(caught.value).startswith(message), caught.value


def test_auto_is_taken_only_where_declared() -> None:
    assert load_settings(env={"FANOUT_SERVER_WORKERS": "auto"}).server.workers >= 1
    with pytest.raises(ConfigError, match="fanout.pool_size: must be an integer, got 'auto'"):
        load_settings(env={"FANOUT_FANOUT_POOL_SIZE": "auto"})
