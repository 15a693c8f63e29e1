"""The embedded sample backends, the shared clients and the lookup registry."""

from __future__ import annotations

import socket
import time
import tomllib
from pathlib import Path
from typing import Any

import gevent
import pymongo
import pytest
import requests
import requests.adapters
from pymongo.errors import PyMongoError

from lookups.backends.collection import Backends
from lookups.backends.settings import (
    HttpBackendSettings,
    MongoBackendSettings,
    backends_from_aliases,
)
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.http import AlertsLookup
from lookups.mongo import ErrorsLookup
from lookups.panels import AlertList, ErrorSummary, Window
from lookups.registry import LookupRegistry, default_registry
from lookups.settings import HttpSettings, MongoSettings
from service.samples import (
    DemoBackends,
    MongoWireServer,
    MongoWireServerError,
    SampleData,
    SampleHttpServices,
    generate_sample_data,
)
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from service.settings.config import Settings, load_settings
from tracing.context import spawn_in_context

SEVEN_PANELS = ("errors", "urls", "controllers", "queries", "alerts", "latency", "volume")


# --- sample data -------------------------------------------------------------------------


def test_sample_data_is_deterministic_per_seed() -> None:
    assert generate_sample_data(5) == generate_sample_data(5)
    assert generate_sample_data(5) != generate_sample_data(6)


def test_sample_data_shape(sample_data: SampleData) -> None:
    stamped: list[Any] = [*sample_data.errors, *sample_data.requests, *sample_data.queries]
    assert all(SAMPLE_START_MS <= r.ts_ms < SAMPLE_END_MS and r.ts_ms % 1000 == 0 for r in stamped)
    assert 1000 <= len(sample_data.requests) <= 10_000
    assert {r.app for r in sample_data.requests} == set(sample_data.apps)
    assert len({r.url for r in sample_data.requests if r.app == "shop"}) > 10
    assert len({r.message for r in sample_data.errors if r.app == "shop"}) > 10
    assert len({r.shape for r in sample_data.queries if r.app == "shop"}) > 10
    assert all(
        r.query != r.shape and r.query.split(" ")[0] == r.shape.split(" ")[0]
        for r in sample_data.queries
    )
    assert len({a.id for a in sample_data.alerts}) == len(sample_data.alerts)


# --- the MongoDB-wire server -------------------------------------------------------------


def _ping(uri: str) -> bool:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        uri, serverSelectionTimeoutMS=300
    )
    try:
        client.admin.command("ping")
        return True
    except PyMongoError:
        return False
    finally:
        client.close()


def test_two_servers_run_side_by_side_and_stop_cleanly() -> None:
    with MongoWireServer() as first, MongoWireServer() as second:
        assert first.port != second.port
        assert _ping(first.uri) and _ping(second.uri)
        workdir = first.workdir
        assert workdir is not None and workdir.exists()
    assert not _ping(first.uri) and not _ping(second.uri)
    assert not workdir.exists()
    first.stop()  # idempotent


def test_killed_server_stops_answering(mongo_server: MongoWireServer) -> None:
    server = MongoWireServer().start()
    try:
        assert _ping(server.uri)
        server.kill()
        assert not _ping(server.uri)
    finally:
        server.stop()
    assert _ping(mongo_server.uri)  # the session's server is untouched


def test_a_server_that_cannot_start_is_reported(tmp_path: Path) -> None:
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'address already in use, giving up' >&2\nexit 3\n")
    fake.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(MongoWireServerError, match="address already in use"):
        MongoWireServer(executable=str(fake), ready_timeout_s=5).start()
    assert time.monotonic() - started < 5 + 2


def test_seeding_loads_every_record_and_indexes(
    mongo_server: MongoWireServer, sample_data: SampleData
) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        mongo_server.uri, serverSelectionTimeoutMS=5000
    )
    try:
        db = client["apm"]
        for name, records in (
            ("errors", sample_data.errors),
            ("requests", sample_data.requests),
            ("queries", sample_data.queries),
        ):
            counted = list(db[name].aggregate([{"$group": {"_id": None, "n": {"$sum": 1}}}]))
            assert counted[0]["n"] == len(records)
            keys = [index["key"] for index in db[name].index_information().values()]
            assert [("app", 1), ("ts", 1)] in keys
    finally:
        client.close()


# --- the sample HTTP services ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/apps/shop/alerts", {"start_ms": 0, "end_ms": 10}, 200),
        ("/apps/nobody/alerts", {"start_ms": 0, "end_ms": 10}, 404),
        ("/apps/shop/alerts", {"start_ms": "x", "end_ms": 10}, 400),
        ("/apps/shop/alerts", {"start_ms": 10, "end_ms": 0}, 400),
        ("/apps/shop/elsewhere", {"start_ms": 0, "end_ms": 10}, 404),
    ],
)
def test_alerts_service_statuses(
    http_services: SampleHttpServices, path: str, params: dict[str, Any], status: int
) -> None:
    response = requests.get(http_services.alerts_url + path, params=params, timeout=5)
    assert response.status_code == status
    assert ("alerts" if status == 200 else "error") in response.json()


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/apps/shop/series/latency", {"start_ms": 0, "end_ms": 10, "step_ms": 60_000}, 200),
        ("/apps/shop/series/errors", {"start_ms": 0, "end_ms": 10, "step_ms": 60_000}, 404),
        ("/apps/shop/series/volume", {"start_ms": 0, "end_ms": 10}, 400),
        ("/apps/shop/series/volume", {"start_ms": 0, "end_ms": 10, "step_ms": 0}, 400),
        ("/apps/shop/series/volume", {"start_ms": 0, "end_ms": 10**12, "step_ms": 1}, 400),
    ],
)
def test_metrics_service_statuses(
    http_services: SampleHttpServices, path: str, params: dict[str, Any], status: int
) -> None:
    response = requests.get(http_services.metrics_url + path, params=params, timeout=5)
    assert response.status_code == status
    assert ("points" if status == 200 else "error") in response.json()


def test_services_answer_get_only(http_services: SampleHttpServices) -> None:
    response = requests.post(http_services.alerts_url + "/apps/shop/alerts", timeout=5)
    assert response.status_code == 405


def test_delayed_services_serve_calls_in_parallel(sample_data: SampleData) -> None:
    with SampleHttpServices(sample_data, alerts_delay_ms=400) as services:
        http = HttpSettings(alerts_url=services.alerts_url, metrics_url=services.metrics_url)
        with Backends(backends_from_aliases(MongoSettings(), http)) as backends:
            lookup = AlertsLookup(backends.http("alerts"))
            window = Window("shop", SAMPLE_START_MS, SAMPLE_END_MS)
            started = time.monotonic()
            workers = [
                spawn_in_context(lookup.fetch, window, Deadline.after_s(5.0)) for _ in range(6)
            ]
            gevent.joinall(workers, timeout=30, raise_error=True)
            elapsed = time.monotonic() - started
    assert all(isinstance(worker.value, AlertList) for worker in workers)
    assert elapsed >= 0.4
    assert services.in_flight.most == 6, "six delayed calls should overlap, not queue"


# --- the demo bundle ---------------------------------------------------------------------


def _refuses(url_or_uri: str) -> bool:
    host_port = url_or_uri.split("//", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, int(port))) != 0


def test_demo_backends_point_a_server_at_themselves(tmp_path: Path) -> None:
    with DemoBackends() as demo:
        overrides = demo.settings_overrides()
        assert set(overrides) == {
            f"backends.{name}.{key}"
            for name, keys in (
                ("mongo", ("kind", "uri", "database")),
                ("alerts", ("kind", "url")),
                ("metrics", ("kind", "url")),
            )
            for key in keys
        }
        config = tmp_path / "fanout.toml"
        config.write_text(demo.config_snippet())
        settings = load_settings(config, env={})
        tables = tomllib.loads(demo.config_snippet())["backends"]
        assert tables["mongo"]["uri"] == overrides["backends.mongo.uri"]
        assert settings.alias_sections == ()  # no deprecated section in what we hand out
        mongo, alerts = settings.backends["mongo"], settings.backends["alerts"]
        assert isinstance(mongo, MongoBackendSettings) and isinstance(alerts, HttpBackendSettings)
        assert (mongo.uri, alerts.url) == (
            overrides["backends.mongo.uri"],
            overrides["backends.alerts.url"],
        )
        with Backends(settings.backends) as backends:
            summary = ErrorsLookup(backends.mongo()).fetch(
                Window("shop", SAMPLE_START_MS, SAMPLE_END_MS), Deadline.after_s(5.0)
            )
        assert isinstance(summary, ErrorSummary)
        assert summary.total == sum(1 for e in demo.data.errors if e.app == "shop")
    assert all(
        _refuses(overrides[key])
        for key in ("backends.mongo.uri", "backends.alerts.url", "backends.metrics.url")
    )


# --- the backends ------------------------------------------------------------------------


def test_backends_open_without_blocking_when_mongo_is_down() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    backends = Backends(
        backends_from_aliases(
            MongoSettings(uri=f"mongodb://127.0.0.1:{port}", server_selection_timeout_ms=5000),
            HttpSettings(),
        )
    )
    assert time.monotonic() - started < 1.0
    assert backends.connections_in_use() == {"mongo": 0, "alerts": 0, "metrics": 0}
    backends.close()
    backends.close()


def test_invalid_mongo_uri_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError) as caught:
        Backends(
            backends_from_aliases(
                MongoSettings(uri="mongodb://admin:hunter2@/nohost"), HttpSettings()
            )
        )
    assert "hunter2" not in str(caught.value) and "mongo.uri" in str(caught.value)


def test_backends_use_the_settings(backend_settings: Settings, backends: Backends) -> None:
    assert backends.names() == ("mongo", "alerts", "metrics")
    assert backends.mongo().db.name == backend_settings.mongo.database
    options = backends.mongo().client.options
    assert options.pool_options.max_pool_size == backend_settings.mongo.max_pool_size
    assert backends.mongo().meter.size == backend_settings.mongo.max_pool_size - 1  # one for health
    for name, url in (
        ("alerts", backend_settings.http.alerts_url),
        ("metrics", backend_settings.http.metrics_url),
    ):
        http = backends.http(name)
        assert (http.settings.url, http.meter.size) == (url, backend_settings.http.pool_maxsize)
        adapter = http.session.get_adapter(url)
        assert isinstance(adapter, requests.adapters.HTTPAdapter)
        assert adapter._pool_maxsize == backend_settings.http.pool_maxsize
        assert adapter._pool_block is True
        assert http.guard.name == name


def test_a_backend_of_the_wrong_kind_or_missing_is_named(backends: Backends) -> None:
    with pytest.raises(KeyError, match="backend 'alerts' is http, not mongo"):
        backends.mongo("alerts")
    with pytest.raises(KeyError, match=r"no backend 'jobs'.*\[backends.jobs\]"):
        backends.http("jobs")


# --- the registry ------------------------------------------------------------------------


def test_default_registry_has_the_seven_panels_in_order(backends: Backends) -> None:
    registry = default_registry()
    assert registry.names() == SEVEN_PANELS
    built = registry.build(backends)
    assert tuple(built) == SEVEN_PANELS
    assert all(lookup.name == name for name, lookup in built.items())
    assert {name: lookup.source for name, lookup in built.items()} == {
        **{name: "mongo" for name in SEVEN_PANELS[:4]},
        **{name: "http" for name in SEVEN_PANELS[4:]},
    }
    assert registry.build(backends)["errors"] is not built["errors"]


class _ConstantAlerts(Lookup):
    name = "constant"
    source = "memory"

    def fetch(self, window: Window, deadline: Deadline) -> AlertList:
        return AlertList(())


def test_registering_a_lookup(backends: Backends) -> None:
    registry = default_registry()
    registry.register("constant", lambda _: _ConstantAlerts())
    assert registry.names()[-1] == "constant"
    assert registry.build(backends)["constant"].fetch(
        Window("a", 0, 1), Deadline.after_s(1.0)
    ) == AlertList(())
    with pytest.raises(ValueError, match="already registered"):
        registry.register("errors", lambda b: ErrorsLookup(b.mongo()))


def test_a_factory_must_build_the_lookup_it_names(backends: Backends) -> None:
    registry = LookupRegistry()
    registry.register("other", lambda _: _ConstantAlerts())
    with pytest.raises(ValueError, match="named 'constant'"):
        registry.build(backends)


def test_a_free_port_for_a_server_is_below_the_range_outgoing_connections_take() -> None:
    """free_port picks below the kernel's ephemeral range, which outgoing connections take
    their local ports from: between the pick and a server's bind, a busy machine's next
    connection could take a port from that range, and the server would not start."""
    from service.samples.mongo_server import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20_000 <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))  # free indeed
