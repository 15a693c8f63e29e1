"""The three HTTP panels against the sample services, and against misbehaving servers.

Expected values are computed here from the SampleData records in plain Python.
"""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from gevent.server import StreamServer

from lookups.backends.collection import Backends
from lookups.backends.settings import backends_from_aliases
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BackendUnavailable, BadBackendResponse, LookupFailed
from lookups.flow import Flow
from lookups.http import AlertsLookup, HttpLookup, LatencyLookup, VolumeLookup, step_ms_for
from lookups.mongo import ErrorsLookup
from lookups.panels import Series, Window
from lookups.settings import HttpSettings, MongoSettings
from service.samples import SampleData, SampleHttpServices
from service.samples.http_services import path_segments, serve_wsgi
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.sockets import dead_port
from tracing.context import spawn_in_context

HOUR_MS = 3_600_000
MINUTE_MS = 60_000

WINDOWS = {
    "day": (SAMPLE_START_MS, SAMPLE_END_MS),
    "outage_hours": (SAMPLE_START_MS + 2 * HOUR_MS, SAMPLE_START_MS + 5 * HOUR_MS),
    "odd_bounds": (
        SAMPLE_START_MS + 7 * HOUR_MS + 17_000,
        SAMPLE_START_MS + 7 * HOUR_MS + 47 * MINUTE_MS + 3_000,
    ),
    "empty": (SAMPLE_END_MS + HOUR_MS, SAMPLE_END_MS + 2 * HOUR_MS),
    "week": (SAMPLE_START_MS - 3 * 24 * HOUR_MS, SAMPLE_START_MS + 4 * 24 * HOUR_MS),
}
APPS = ["shop", "search", "billing"]


def _expected_step(window: Window) -> int:
    """At most 120 points, whole minutes, at least one minute."""
    minutes = max(1, math.ceil((window.end_ms - window.start_ms) / MINUTE_MS / 120))
    return minutes * MINUTE_MS


def _expected_series(data: SampleData, window: Window, metric: str) -> list[tuple[int, float]]:
    step = _expected_step(window)
    buckets: dict[int, list[float]] = defaultdict(list)
    for sample in data.metrics:
        if sample.app == window.app and window.start_ms <= sample.ts_ms < window.end_ms:
            bucket_start = window.start_ms + (sample.ts_ms - window.start_ms) // step * step
            buckets[bucket_start].append(
                sample.latency_ms if metric == "latency" else sample.volume
            )
    if metric == "latency":
        return [(ts, sum(v) / len(v)) for ts, v in sorted(buckets.items())]
    return [(ts, float(sum(v))) for ts, v in sorted(buckets.items())]


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", list(WINDOWS))
def test_alerts_panel(
    backends: Backends, sample_data: SampleData, app: str, window_name: str
) -> None:
    window = Window(app, *WINDOWS[window_name])
    expected = sorted(
        (a.triggered_ms, a.id, a.severity, a.title)
        for a in sample_data.alerts
        if a.app == app and window.start_ms <= a.triggered_ms < window.end_ms
    )
    alerts = AlertsLookup(backends.http(AlertsLookup.backend_name)).fetch(
        window, Deadline.after_s(5.0)
    )
    assert [(a.triggered_ms, a.id, a.severity, a.title) for a in alerts.alerts] == expected


def test_alerts_at_the_same_instant_are_ordered_by_id(
    backends: Backends, sample_data: SampleData
) -> None:
    window = Window("shop", *WINDOWS["day"])
    alerts = (
        AlertsLookup(backends.http(AlertsLookup.backend_name))
        .fetch(window, Deadline.after_s(5.0))
        .alerts
    )
    stamps = [a.triggered_ms for a in alerts]
    tied = [a.id for a in alerts if stamps.count(a.triggered_ms) > 1]
    assert len(tied) >= 2 and tied == sorted(tied)


@pytest.mark.parametrize("lookup_class", [LatencyLookup, VolumeLookup])
@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("window_name", list(WINDOWS))
def test_series_panels(
    backends: Backends,
    sample_data: SampleData,
    lookup_class: type[HttpLookup],
    app: str,
    window_name: str,
) -> None:
    window = Window(app, *WINDOWS[window_name])
    series = lookup_class(backends.http(lookup_class.backend_name)).fetch(
        window, Deadline.after_s(5.0)
    )
    assert isinstance(series, Series), series
    expected = _expected_series(sample_data, window, lookup_class.name)
    assert series.step_ms == _expected_step(window)
    assert len(series.points) <= 120
    assert [p.ts_ms for p in series.points] == [ts for ts, _ in expected]
    assert [p.value for p in series.points] == pytest.approx([v for _, v in expected], rel=1e-9)


def test_whole_day_series_has_120_twelve_minute_points(backends: Backends) -> None:
    series = LatencyLookup(backends.http(LatencyLookup.backend_name)).fetch(
        Window("shop", *WINDOWS["day"]), Deadline.after_s(5.0)
    )
    assert series.step_ms == 12 * MINUTE_MS and len(series.points) == 120


def test_unknown_app_is_a_bad_response(backends: Backends) -> None:
    for lookup_class in (AlertsLookup, LatencyLookup):
        with pytest.raises(BadBackendResponse) as caught:
            lookup_class(backends.http(lookup_class.backend_name)).fetch(
                Window("no-such-app", *WINDOWS["day"]), Deadline.after_s(5.0)
            )
        assert caught.value.retryable is False and "404" in str(caught.value)


# --- misbehaving servers ---------------------------------------------------------------


def _misbehaving_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
    """Behaves as its first path segment says: /<mode>/apps/<app>/..."""
    mode = path_segments(environ)[0]
    if mode == "hang":
        gevent.sleep(30)
    if mode == "drip":
        start_response("200 OK", [("Content-Type", "application/json")])
        return (gevent.sleep(0.05) or b" " for _ in range(600))
    if mode == "big":
        start_response("200 OK", [("Content-Type", "application/json")])
        return (b" " * 65536 for _ in range(100))
    status, body = {
        "error500": ("500 Internal Server Error", b'{"error": "boom"}'),
        "error503": ("503 Service Unavailable", b""),
        "error400": ("400 Bad Request", b'{"error": "bad"}'),
        "redirect": ("302 Found", b""),
        "notjson": ("200 OK", b'{"alerts": ['),
        "nan": (
            "200 OK",
            b'{"points": [[1, NaN]], "alerts": [{"id": "a", "severity": "x", '
            b'"title": "t", "triggered_ms": Infinity}]}',
        ),
        "list": ("200 OK", b"[1, 2]"),
        "wrongtype": (
            "200 OK",
            b'{"points": [[1, "x"]], "alerts": [{"id": 5, "severity": "x", '
            b'"title": "t", "triggered_ms": 1}]}',
        ),
        "bools": (
            "200 OK",
            b'{"points": [[true, 1]], "alerts": [{"id": "a", "severity": "x", '
            b'"title": "t", "triggered_ms": true}]}',
        ),
        "missing": ("200 OK", b'{"points": [[1]], "alerts": [{"id": "a"}]}'),
    }.get(mode, ("404 Not Found", b""))
    start_response(
        status,
        [
            ("Content-Type", "application/json"),
            ("Location", "http://example.invalid/"),
            ("Content-Length", str(len(body))),
        ],
    )
    return [body]


@pytest.fixture(scope="module")
def misbehaving_url() -> Iterator[str]:
    with serve_wsgi(_misbehaving_app) as server:  # stops it (1 s timeout) on leaving
        yield f"http://127.0.0.1:{server.server_port}"


@pytest.fixture
def open_backends() -> Iterator[Callable[..., Backends]]:
    """Builds Backends on given HTTP settings and closes them all after the test."""
    opened: list[Backends] = []

    def open_with(**http: Any) -> Backends:
        opened.append(Backends(backends_from_aliases(MongoSettings(), HttpSettings(**http))))
        return opened[-1]

    yield open_with
    for backends in opened:
        backends.close()


def _fetch(backends: Backends, lookup_class: type[HttpLookup], budget_s: float = 5.0) -> Any:
    return lookup_class(backends.http(lookup_class.backend_name)).fetch(
        Window("shop", *WINDOWS["day"]), Deadline.after_s(budget_s)
    )


@pytest.mark.parametrize(
    ("mode", "error", "retryable"),
    [
        ("error500", BackendUnavailable, True),
        ("error503", BackendUnavailable, True),
        ("error400", BadBackendResponse, False),
        ("redirect", BadBackendResponse, False),
        ("notjson", BadBackendResponse, False),
        ("nan", BadBackendResponse, False),
        ("list", BadBackendResponse, False),
        ("wrongtype", BadBackendResponse, False),
        ("bools", BadBackendResponse, False),
        ("missing", BadBackendResponse, False),
        ("big", BadBackendResponse, False),
    ],
)
@pytest.mark.parametrize("lookup_class", [AlertsLookup, VolumeLookup])
def test_bad_answers_are_typed_errors(
    open_backends: Callable[..., Backends],
    misbehaving_url: str,
    mode: str,
    error: type[LookupFailed],
    retryable: bool,
    lookup_class: type[HttpLookup],
) -> None:
    url = f"{misbehaving_url}/{mode}"
    backends = open_backends(alerts_url=url, metrics_url=url)
    with pytest.raises(error) as caught:
        _fetch(backends, lookup_class)
    assert type(caught.value) is error and caught.value.retryable is retryable
    assert backends.connections_in_use()["alerts"] + backends.connections_in_use()["metrics"] == 0


@pytest.mark.parametrize(
    ("mode", "http_settings"),
    [
        ("hang", {"read_timeout_ms": 10_000}),  # the task budget cuts the read
        ("hang", {"read_timeout_ms": 200}),  # http.read_timeout_ms cuts it first
        ("drip", {"read_timeout_ms": 10_000}),  # each byte is in time; the total is not
    ],
)
def test_slow_servers_time_out_within_budget(
    open_backends: Callable[..., Backends],
    misbehaving_url: str,
    mode: str,
    http_settings: dict[str, int],
) -> None:
    url = f"{misbehaving_url}/{mode}"
    backends = open_backends(alerts_url=url, metrics_url=url, **http_settings)
    started = time.monotonic()
    with pytest.raises(BackendTimeout) as caught:
        _fetch(backends, LatencyLookup, budget_s=0.5)
    assert time.monotonic() - started < 0.5 + 1.5
    assert caught.value.retryable is True
    assert backends.connections_in_use()["alerts"] + backends.connections_in_use()["metrics"] == 0


def test_connection_refused_is_unavailable(open_backends: Callable[..., Backends]) -> None:
    url = f"http://127.0.0.1:{dead_port()}"
    backends = open_backends(alerts_url=url, metrics_url=url)
    started = time.monotonic()
    for lookup_class in (AlertsLookup, LatencyLookup):
        with pytest.raises(BackendUnavailable) as caught:
            _fetch(backends, lookup_class, budget_s=1.0)
        assert caught.value.retryable is True
    assert time.monotonic() - started < 2 * 1.0 + 1.5


@pytest.fixture
def hang_up_url() -> Iterator[str]:
    """A TCP server that reads the request and closes the connection without answering."""

    def hang_up(connection: socket.socket, address: Any) -> None:
        connection.recv(65536)
        connection.close()

    server = StreamServer(("127.0.0.1", 0), hang_up)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.stop(timeout=1)


def test_connection_closed_without_answer_is_unavailable(
    open_backends: Callable[..., Backends], hang_up_url: str
) -> None:
    backends = open_backends(alerts_url=hang_up_url, metrics_url=hang_up_url)
    for lookup_class in (AlertsLookup, VolumeLookup):
        with pytest.raises(BackendUnavailable):
            _fetch(backends, lookup_class)
    assert backends.connections_in_use()["alerts"] + backends.connections_in_use()["metrics"] == 0


def test_spent_budget_is_a_timeout(backends: Backends) -> None:
    for budget in (0.0, -0.5):
        with pytest.raises(BackendTimeout):
            _fetch(backends, AlertsLookup, budget_s=budget)


def test_connections_are_returned_after_a_burst(
    open_backends: Callable[..., Backends], misbehaving_url: str, http_services: SampleHttpServices
) -> None:
    slow = open_backends(
        alerts_url=http_services.alerts_url, metrics_url=f"{misbehaving_url}/hang", pool_maxsize=4
    )
    outcomes: list[str] = []

    def run(index: int) -> None:
        lookup_class = (AlertsLookup, LatencyLookup, VolumeLookup)[index % 3]
        try:
            _fetch(slow, lookup_class, budget_s=0.3)
            outcomes.append("ok")
        except LookupFailed as exc:
            outcomes.append(type(exc).__name__)

    workers = [spawn_in_context(run, index) for index in range(12)]
    gevent.joinall(workers, timeout=30, raise_error=True)
    assert "ok" in outcomes and "BackendTimeout" in outcomes and len(outcomes) == 12
    assert slow.connections_in_use()["alerts"] + slow.connections_in_use()["metrics"] == 0


def test_the_counter_sees_a_held_connection(
    backends: Backends, http_services: SampleHttpServices
) -> None:
    response = backends.http("alerts").session.get(
        f"{http_services.alerts_url}/apps/shop/alerts",
        params={"start_ms": 0, "end_ms": 1},
        stream=True,
        timeout=5,
    )
    try:
        assert (
            backends.connections_in_use()["alerts"] + backends.connections_in_use()["metrics"] == 1
        )
    finally:
        response.close()
    assert backends.connections_in_use()["alerts"] + backends.connections_in_use()["metrics"] == 0


# --- app names in the URL path -----------------------------------------------------------


@pytest.fixture
def recording_url() -> Iterator[tuple[str, list[str]]]:
    """A server that records each raw request path and answers an empty, valid body."""
    seen: list[str] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(environ["RAW_URI"])
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"alerts": [], "points": []}).encode()]

    with serve_wsgi(app) as server:
        yield f"http://127.0.0.1:{server.server_port}/base", seen


@pytest.mark.parametrize(
    ("app", "segment"),
    [
        ("shop", "shop"),
        ("a/b", "a%2Fb"),
        ("../../admin", "..%2F..%2Fadmin"),
        ("x?y=1#z", "x%3Fy%3D1%23z"),
        ("café 100%", "caf%C3%A9%20100%25"),
    ],
)
def test_app_names_stay_one_quoted_segment(
    open_backends: Callable[..., Backends],
    recording_url: tuple[str, list[str]],
    app: str,
    segment: str,
) -> None:
    base, seen = recording_url
    backends = open_backends(alerts_url=base, metrics_url=base + "/")
    window = Window(app, *WINDOWS["day"])
    AlertsLookup(backends.http(AlertsLookup.backend_name)).fetch(window, Deadline.after_s(5.0))
    VolumeLookup(backends.http(VolumeLookup.backend_name)).fetch(window, Deadline.after_s(5.0))
    paths = [raw.split("?", 1)[0] for raw in seen]
    assert paths == [f"/base/apps/{segment}/alerts", f"/base/apps/{segment}/series/volume"]
    assert all(urllib.parse.unquote(p.split("/")[3]) == app for p in paths)


@pytest.fixture
def cookie_setting_url() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server that sets a new cookie on every answer and records what each request sent."""
    seen: list[dict[str, str]] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(
            {
                "query": environ["QUERY_STRING"],
                "cookie": environ.get("HTTP_COOKIE", ""),
                "accept": environ.get("HTTP_ACCEPT", ""),
                "authorization": environ.get("HTTP_AUTHORIZATION", ""),
            }
        )
        start_response(
            "200 OK",
            [("Content-Type", "application/json"), ("Set-Cookie", f"visit{len(seen)}=1; Path=/")],
        )
        return [json.dumps({"alerts": [], "points": []}).encode()]

    with serve_wsgi(app) as server:
        yield f"http://127.0.0.1:{server.server_port}", seen


def test_requests_carry_the_window_and_headers_and_no_cookies_are_sent_or_kept(
    open_backends: Callable[..., Backends], cookie_setting_url: tuple[str, list[dict[str, str]]]
) -> None:
    base, seen = cookie_setting_url
    backends = open_backends(alerts_url=base, metrics_url=base, auth_token="s3cret")
    window = Window("shop", *WINDOWS["day"])
    for _ in range(3):
        AlertsLookup(backends.http(AlertsLookup.backend_name)).fetch(window, Deadline.after_s(5.0))
    VolumeLookup(backends.http(VolumeLookup.backend_name)).fetch(window, Deadline.after_s(5.0))
    start_ms, end_ms = WINDOWS["day"]
    assert [r["query"] for r in seen] == [f"start_ms={start_ms}&end_ms={end_ms}"] * 3 + [
        f"start_ms={start_ms}&end_ms={end_ms}&step_ms={step_ms_for(window)}"
    ]
    assert {r["accept"] for r in seen} == {"application/json"}
    assert {r["authorization"] for r in seen} == {"Bearer s3cret"}
    assert [r["cookie"] for r in seen] == [""] * 4
    assert all(len(backends.http(name).session.cookies) == 0 for name in ("alerts", "metrics"))


@pytest.mark.parametrize("app", ["", ".", ".."])
def test_dot_segment_app_names_are_refused(
    open_backends: Callable[..., Backends], recording_url: tuple[str, list[str]], app: str
) -> None:
    base, seen = recording_url
    backends = open_backends(alerts_url=base, metrics_url=base)
    for lookup_class in (AlertsLookup, LatencyLookup):
        with pytest.raises(LookupFailed) as caught:
            lookup_class(backends.http(lookup_class.backend_name)).fetch(
                Window(app, *WINDOWS["day"]), Deadline.after_s(5.0)
            )
        assert caught.value.retryable is False
    assert seen == []


@pytest.mark.parametrize("kind", ["http", "mongo"])
def test_a_backends_free_slot_goes_to_the_waiting_lookup_whose_call_is_most_critical(
    backends: Backends, kind: str
) -> None:
    """Each backend waits for its slots in the place its call's deadline carries."""
    if kind == "http":
        lookup: Lookup = AlertsLookup(backends.http("alerts"))
    else:
        lookup = ErrorsLookup(backends.mongo())
    slots = lookup.backend.slots  # type: ignore[attr-defined]
    held = 0
    while slots.acquire(blocking=False):
        held += 1
    done: list[str] = []

    def fetch(name: str, flow: Flow) -> None:
        lookup.fetch(Window("shop", *WINDOWS["day"]), Deadline.after_s(5.0).for_flow(flow))
        done.append(name)

    try:
        tasks = []
        for name, flow in (("report", Flow(rank=2, caller="reports")), ("page", Flow(rank=0))):
            tasks.append(gevent.spawn(fetch, name, flow))
            gevent.sleep(0)  # in the line before the next comes
        slots.release()  # one slot: the page's, then the report's once the page gives it back
        held -= 1
        gevent.joinall(tasks, timeout=10, raise_error=True)
    finally:
        for _ in range(held):
            slots.release()
    assert done == ["page", "report"]
