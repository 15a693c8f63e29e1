"""Pytest plugin: the embedded sample backends, seeded, and clients built on them.

Session-scoped: ``sample_data``, ``mongo_server`` (one MongoDB-wire server, seeded:
nx-27017, or FerretDB under ``FANOUT_TEST_MONGO_ENGINE=ferretdb``) and ``http_services``
(the alerts and metrics services). Function-scoped:
``backends`` (the :class:`lookups.backends.collection.Backends` on them, closed after the test),
``backend_settings`` (a full :class:`service.settings.config.Settings` pointing at them) and
``start_service`` (a whole Fanout server on port 0 over them, with a client).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lookups.backends.collection import Backends
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.registry import LookupRegistry
from service.app import FanOutService
from service.client import AppStatsClient
from service.samples import (
    MongoWireServer,
    SampleData,
    SampleHttpServices,
    generate_sample_data,
    seed_mongo_at,
)
from service.settings.config import Settings, load_settings
from tests.support.ferretdb import FerretDbServer, selected_engine

__all__ = [
    "SAMPLE_DATABASE",
    "GENEROUS_BUDGETS",
    "sample_data",
    "mongo_server",
    "http_services",
    "backends",
    "backend_settings",
    "backend_overrides",
    "StartService",
    "start_service",
]

SAMPLE_DATABASE = "apm"
#: Dotted settings keys giving a server budgets that a starved machine does not run out
#: of, for tests about what a call runs or answers rather than about its budgets. The
#: driver's monitor too: on a starved machine its 1 s check timed out, and pymongo
#: cancelled every operation in flight with it.
GENEROUS_BUDGETS = {
    "fanout.task_timeout_ms": 30_000,
    "fanout.request_deadline_ms": 30_000,
    "http.read_timeout_ms": 30_000,
}


@pytest.fixture(scope="session")
def sample_data() -> SampleData:
    return generate_sample_data()


@pytest.fixture(scope="session")
def mongo_server(sample_data: SampleData) -> Iterator[MongoWireServer | FerretDbServer]:
    """One MongoDB-wire server for the session, seeded with ``sample_data`` in ``apm``.

    nx-27017 by default; FerretDB 2 on PostgreSQL with DocumentDB under
    ``FANOUT_TEST_MONGO_ENGINE=ferretdb`` (``make compat``).
    """
    engine = selected_engine()
    with FerretDbServer() if engine == "ferretdb" else MongoWireServer() as server:
        seed_mongo_at(server.uri, SAMPLE_DATABASE, sample_data)
        yield server


@pytest.fixture(scope="session")
def http_services(sample_data: SampleData) -> Iterator[SampleHttpServices]:
    with SampleHttpServices(sample_data) as services:
        yield services


def backend_overrides(
    mongo: MongoWireServer | FerretDbServer, http: SampleHttpServices
) -> dict[str, str]:
    """Dotted settings keys pointing at the running sample backends."""
    return {
        "mongo.uri": mongo.uri,
        "mongo.database": SAMPLE_DATABASE,
        "http.alerts_url": http.alerts_url,
        "http.metrics_url": http.metrics_url,
    }


@pytest.fixture
def backend_settings(mongo_server: MongoWireServer, http_services: SampleHttpServices) -> Settings:
    return load_settings(env={}, overrides=backend_overrides(mongo_server, http_services))


@pytest.fixture
def backends(backend_settings: Settings) -> Iterator[Backends]:
    with Backends(backend_settings.backends) as opened:
        yield opened


StartService = Callable[..., tuple[FanOutService, AppStatsClient]]


@pytest.fixture
def start_service(
    mongo_server: MongoWireServer, http_services: SampleHttpServices
) -> Iterator[StartService]:
    """Start a Fanout server on port 0 over the sample backends; stopped after the test.

    ``start(http=None, registry=None, clock=SYSTEM_CLOCK, **overrides)``: ``http`` replaces
    the sample HTTP services, ``registry`` the default lookups, ``clock`` the machine's
    (service/testing.py); override keys use ``__`` for dots
    (``fanout__pool_size=4``).
    """
    started: list[tuple[FanOutService, AppStatsClient]] = []

    def start(
        http: SampleHttpServices | None = None,
        registry: LookupRegistry | None = None,
        clock: Clock = SYSTEM_CLOCK,
        **overrides: Any,
    ) -> tuple[FanOutService, AppStatsClient]:
        keys = {
            **backend_overrides(mongo_server, http or http_services),
            "server.port": 0,
            **{key.replace("__", "."): value for key, value in overrides.items()},
        }
        settings = load_settings(env={}, overrides=keys)
        service = FanOutService(settings, registry=registry, clock=clock).start()
        client = AppStatsClient(*service.address, timeout_ms=5000)
        started.append((service, client))
        return service, client

    yield start
    for service, client in started:
        client.close()
        service.stop()
