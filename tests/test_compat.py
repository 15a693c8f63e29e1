"""The MongoDB panels end to end on a production-grade engine: FerretDB 2 on PostgreSQL
with DocumentDB, against nx-27017, through ``fanout serve`` and a real Thrift client.

Both engines are seeded with the same sample data; every MongoDB panel of every app (and
an app with no data) over two windows must come back OK and equal, floats within a
tolerance. ``make compat`` builds the engine and runs this with the MongoDB lookup tests
on it (``FANOUT_TEST_MONGO_ENGINE=ferretdb``); without the engine this module is skipped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from service.client import AppStatsClient
from service.samples import (
    SAMPLE_END_MS,
    SAMPLE_START_MS,
    MongoWireServer,
    SampleData,
    SampleHttpServices,
    seed_mongo_at,
)
from tests.support.ferretdb import FerretDbServer
from tests.support.processes import Server, server_environment
from tests.support.samples import SAMPLE_DATABASE
from tests.support.toolchains import needs

pytestmark = needs("compat")

HOUR_MS = 3_600_000
APPS = ["shop", "search", "billing", "no-such-app"]
WINDOWS = {
    "day": (SAMPLE_START_MS, SAMPLE_END_MS),
    "three_hours": (SAMPLE_START_MS + 6 * HOUR_MS, SAMPLE_START_MS + 9 * HOUR_MS),
}
MONGO_PANELS = ["errors", "urls", "controllers", "queries"]
FLOAT_TOLERANCE: dict[str, Any] = {"rel": 1e-9, "abs": 1e-6}


@pytest.fixture(scope="module")
def engines(sample_data: SampleData, mongo_server: Any) -> Iterator[dict[str, Any]]:
    """Both engines, running and seeded with the same data: the session's server is one of
    them (nx-27017, or FerretDB under ``make compat``), and the other is started here."""
    with contextlib.ExitStack() as stack:
        found: dict[str, Any] = (
            {"ferretdb": mongo_server}
            if isinstance(mongo_server, FerretDbServer)
            else {"nx-27017": mongo_server}
        )
        for name, kind in (("ferretdb", FerretDbServer), ("nx-27017", MongoWireServer)):
            if name not in found:
                found[name] = stack.enter_context(kind())
                seed_mongo_at(found[name].uri, SAMPLE_DATABASE, sample_data)
        yield found


def test_the_engine_is_ferretdb_2_on_documentdb(engines: dict[str, Any]) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(engines["ferretdb"].uri)
    try:
        info = client.admin.command("buildInfo")
        # DocumentDB keeps the documents: FerretDB 2 has no other storage.
        assert info["ferretdb"]["version"].startswith("v2.")
        assert client[SAMPLE_DATABASE].requests.estimated_document_count() > 0
    finally:
        client.close()


def _flatten(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a Thrift value with its path, so two answers compare leaf by leaf."""
    if hasattr(value, "thrift_spec"):
        for _, spec in sorted(value.thrift_spec.items()):
            yield from _flatten(getattr(value, spec[1]), f"{path}.{spec[1]}")
    elif isinstance(value, dict):
        yield f"{path}{{}}", sorted(value)
        for key in sorted(value):
            yield from _flatten(value[key], f"{path}[{key!r}]")
    elif isinstance(value, list):
        yield f"{path}#", len(value)
        for index, item in enumerate(value):
            yield from _flatten(item, f"{path}[{index}]")
    else:
        yield path, value


def _assert_same_panels(ferretdb: Any, nx: Any, where: str) -> None:
    left, right = list(_flatten(ferretdb.panels)), list(_flatten(nx.panels))
    assert [path for path, _ in left] == [path for path, _ in right], where
    for (path, a), (_, b) in zip(left, right):
        if isinstance(a, float) or isinstance(b, float):
            assert not math.isnan(a) and a == pytest.approx(b, **FLOAT_TOLERANCE), f"{where} {path}"
        else:
            assert a == b, f"{where} {path}"


def test_fanout_serve_answers_the_same_panels_on_ferretdb_as_on_nx_27017(
    engines: dict[str, Any], http_services: SampleHttpServices, tmp_path: Path
) -> None:
    servers = {
        name: Server(server_environment(engine, http_services), tmp_path / f"{name}.log")
        for name, engine in engines.items()
    }
    clients = {
        name: AppStatsClient("127.0.0.1", server.port, timeout_ms=10_000)
        for name, server in servers.items()
    }
    try:
        non_empty = 0
        for app in APPS:
            for window_name, (start_ms, end_ms) in WINDOWS.items():
                answers = {
                    name: client.get_app_stats(app, start_ms, end_ms, MONGO_PANELS)
                    for name, client in clients.items()
                }
                where = f"{app} over {window_name}"
                for name, answer in answers.items():
                    statuses = {o.name: (o.status, o.message) for o in answer.outcomes}
                    assert {o.status for o in answer.outcomes} == {0}, (
                        f"{name}: {where}: {statuses}"
                    )
                    assert sorted(answer.panels) == sorted(MONGO_PANELS), f"{name}: {where}"
                _assert_same_panels(answers["ferretdb"], answers["nx-27017"], where)
                non_empty += answers["ferretdb"].panels["errors"].error_summary.total > 0
        assert non_empty == 6  # three apps with data, two windows: not a comparison of empties
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.kill()
