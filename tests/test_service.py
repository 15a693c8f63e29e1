"""End to end: real client -> real Thrift server -> fan-out -> nx-27017 and HTTP services.

Expected values are computed here from the seed records, independently of the lookups.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData, SampleHttpServices
from tests.support.samples import StartService

ALL_PANELS = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]
MONGO_PANELS = ALL_PANELS[:4]
HTTP_PANELS = ALL_PANELS[4:]
Status = appstats.TaskStatus


@pytest.fixture
def slow_http(sample_data: SampleData) -> Iterator[Callable[[int], SampleHttpServices]]:
    made: list[SampleHttpServices] = []

    def make(delay_ms: int) -> SampleHttpServices:
        services = SampleHttpServices(
            sample_data, alerts_delay_ms=delay_ms, metrics_delay_ms=delay_ms
        )
        made.append(services.start())
        return services

    yield make
    for services in made:
        services.stop()


def statuses(response: Any) -> dict[str, int]:
    return {o.name: o.status for o in response.outcomes}


def test_seven_panels_end_to_end(start_service: StartService, sample_data: SampleData) -> None:
    _, client = start_service()
    start, end = SAMPLE_START_MS + 6 * 3_600_000, SAMPLE_START_MS + 18 * 3_600_000
    response = client.get_app_stats("shop", start, end)

    assert [o.name for o in response.outcomes] == ALL_PANELS
    assert set(statuses(response).values()) == {Status.OK}
    assert sorted(response.panels) == sorted(ALL_PANELS)
    assert len(response.trace_id) == 32 and int(response.trace_id, 16) != 0

    errors = [e for e in sample_data.errors if e.app == "shop" and start <= e.ts_ms < end]
    assert response.panels["errors"].error_summary.total == len(errors)
    top_messages = sorted(
        Counter(e.message for e in errors).items(), key=lambda kv: (-kv[1], kv[0])
    )[:10]
    assert [
        (m.message, m.count) for m in response.panels["errors"].error_summary.top
    ] == top_messages

    hits = [r for r in sample_data.requests if r.app == "shop" and start <= r.ts_ms < end]
    top_urls = sorted(Counter(r.url for r in hits).items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    assert [(e.key, e.count) for e in response.panels["urls"].top_list.entries] == top_urls

    alerts = sorted(
        (a for a in sample_data.alerts if a.app == "shop" and start <= a.triggered_ms < end),
        key=lambda a: (a.triggered_ms, a.id),
    )
    assert [a.id for a in response.panels["alerts"].alert_list.alerts] == [a.id for a in alerts]

    # Bucketing moves volume between points but never loses or invents any.
    minutes = [m for m in sample_data.metrics if m.app == "shop" and start <= m.ts_ms < end]
    volume = response.panels["volume"].series
    assert sum(p.value for p in volume.points) == pytest.approx(sum(m.volume for m in minutes))
    assert all(start <= p.ts_ms < end for p in volume.points)


def test_http_lookups_run_in_parallel(
    start_service: StartService, slow_http: Callable[[int], SampleHttpServices]
) -> None:
    http = slow_http(200)
    _, client = start_service(http=http)
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, HTTP_PANELS)
    assert set(statuses(response).values()) == {Status.OK}
    assert all(o.elapsed_ms >= 190 for o in response.outcomes)
    # All three were being answered at once (in sequence: one at a time). Counted, not
    # timed: a loop stalled by a busy host lengthens the call, not the overlap.
    assert http.in_flight.most == len(HTTP_PANELS) == 3


@pytest.mark.solo  # ten replies due at one instant: among other processes they came late
def test_client_deadline_cuts_a_hanging_backend_and_leaks_nothing(
    start_service: StartService, slow_http: Callable[[int], SampleHttpServices]
) -> None:
    service, _ = start_service(http=slow_http(5000))
    # A burst of concurrent calls, each cut by its own deadline while HTTP hangs. The
    # deadline leaves the aggregations time to end first, so that at the deadline the
    # server has only the replies to write within the client's margin.
    burst = AppStatsClient(*service.address, pool_size=10, timeout_ms=5000)
    began = time.monotonic()
    calls = [
        gevent.spawn(burst.get_app_stats, "shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=1500)
        for _ in range(10)
    ]
    gevent.joinall(calls, timeout=10, raise_error=True)
    assert time.monotonic() - began < 4.0  # HTTP answers after 5 s
    burst.close()
    for call in calls:
        got = statuses(call.value)
        # 40 aggregations at once can outrun the single-threaded test server: OK or TIMEOUT.
        assert {got[name] for name in MONGO_PANELS} <= {Status.OK, Status.TIMEOUT}
        assert {got[name] for name in HTTP_PANELS} == {Status.TIMEOUT}
        assert all(o.retryable for o in call.value.outcomes if o.status == Status.TIMEOUT)
        assert sorted(call.value.panels) == sorted(n for n in MONGO_PANELS if got[n] == Status.OK)
    client = AppStatsClient(*service.address, timeout_ms=5000)

    # The budget was pushed into requests, so the stragglers end by themselves.
    assert service.fanout.wait_reapers(timeout_s=5)
    assert service.fanout.inflight == 0
    assert service.backends.connections_in_use() == {"mongo": 0, "alerts": 0, "metrics": 0}
    with client:
        again = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, MONGO_PANELS)
    assert set(statuses(again).values()) == {Status.OK}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (
            dict(
                app="shop", start_ms=SAMPLE_START_MS, end_ms=SAMPLE_END_MS, panels=["errors", "cpu"]
            ),
            "panels",
        ),
        (dict(app="../etc", start_ms=SAMPLE_START_MS, end_ms=SAMPLE_END_MS), "app"),
        (dict(app="shop", start_ms=SAMPLE_END_MS, end_ms=SAMPLE_START_MS), "end_ms"),
    ],
)
def test_bad_requests_get_invalid_request(
    start_service: StartService, kwargs: dict[str, Any], field: str
) -> None:
    _, client = start_service()
    with pytest.raises(appstats.InvalidRequest) as caught:
        client.get_app_stats(**kwargs)
    assert caught.value.field == field
    assert client.ping() == "pong"  # the connection and server are fine


def test_required_panel_failure_raises_panel_failed(start_service: StartService) -> None:
    _, client = start_service(
        **{"http__alerts_url": "http://127.0.0.1:9", "lookups__alerts__required": True}
    )
    with pytest.raises(appstats.PanelFailed) as caught:
        client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    failure = caught.value
    assert failure.panel == "alerts"
    by_name = {o.name: o for o in failure.outcomes}
    assert sorted(by_name) == sorted(ALL_PANELS)
    assert by_name["alerts"].status == Status.ERROR and by_name["alerts"].retryable
    assert by_name["alerts"].error_type == "BackendUnavailable"
    assert {o.status for o in failure.outcomes} <= {Status.OK, Status.ERROR, Status.CANCELLED}


def test_optional_panel_failure_keeps_the_rest(start_service: StartService) -> None:
    # Budgets a busy machine keeps: the panels that answer must not run out of time.
    _, client = start_service(
        **{"http__metrics_url": "http://127.0.0.1:9", "fanout__request_deadline_ms": 20_000},
        **{f"lookups__{name}__timeout_ms": 15_000 for name in ALL_PANELS},
    )
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=20_000)
    got = statuses(response)
    assert got["latency"] == got["volume"] == Status.ERROR
    assert {got[name] for name in ["errors", "urls", "controllers", "queries", "alerts"]} == {
        Status.OK
    }
    assert "latency" not in response.panels and "errors" in response.panels


def test_disabled_panel_is_skipped_and_not_offered(start_service: StartService) -> None:
    _, client = start_service(**{"lookups__volume__enabled": False})
    assert client.panels() == [p for p in ALL_PANELS if p != "volume"]
    default = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    assert "volume" not in statuses(default)
    asked = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["volume", "errors"])
    assert statuses(asked) == {"volume": Status.SKIPPED, "errors": Status.OK}


def test_no_free_slot_answers_overloaded(
    start_service: StartService, slow_http: Callable[[int], SampleHttpServices]
) -> None:
    _, client = start_service(
        http=slow_http(800), **{"fanout__max_inflight_tasks": 1, "fanout__queue_timeout_ms": 50}
    )
    hog = gevent.spawn(client.get_app_stats, "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["alerts"])
    gevent.sleep(0.2)
    with pytest.raises(appstats.Overloaded) as caught:
        client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["latency", "volume"])
    assert caught.value.retry_after_ms > 0
    assert statuses(hog.get(timeout=5)) == {"alerts": Status.OK}


def test_trace_tree_spans_the_whole_path(start_service: StartService, spans: Any) -> None:
    _, client = start_service()
    with trace.get_tracer("test").start_as_current_span("web tier") as caller:
        response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    caller_trace = format(caller.get_span_context().trace_id, "032x")
    assert response.trace_id == caller_trace

    finished = [
        s for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == caller_trace
    ]
    by_id = {s.context.span_id: s for s in finished}
    (server,) = [s for s in finished if s.kind is SpanKind.SERVER]
    assert server.name == "AppStats/get_app_stats"
    assert server.attributes["rpc.method"] == "AppStats/get_app_stats"
    assert server.attributes["fanout.caller"] == "anonymous"  # the call named no caller
    assert server.attributes["fanout.caller.weight"] == 1.0
    tasks = [s for s in finished if s.name.startswith("fanout.task ")]
    assert sorted(t.attributes["fanout.task.name"] for t in tasks) == sorted(ALL_PANELS)
    assert {t.parent.span_id for t in tasks} == {server.context.span_id}
    assert all(
        t.attributes["fanout.async"] and t.attributes["fanout.task.status"] == "OK" for t in tasks
    )
    # The server span descends from the caller's span (directly or via the client's span).
    ancestor = server
    while ancestor.parent is not None and ancestor.parent.span_id in by_id:
        ancestor = by_id[ancestor.parent.span_id]
    assert ancestor.context.span_id == caller.get_span_context().span_id

    for task in tasks:
        children = [
            s for s in finished if s.parent is not None and s.parent.span_id == task.context.span_id
        ]
        assert children, f"no library span under {task.name}"
        assert all(c.kind is SpanKind.CLIENT for c in children)
        if task.attributes["fanout.task.source"] == "mongo":
            assert any(c.attributes.get("db.system.name") == "mongodb" for c in children)
    # Parallel: every task started before any task ended.
    assert max(t.start_time for t in tasks) < min(t.end_time for t in tasks)
    # Within the call the caller saw, with the connection's endpoints on the server span.
    assert all(t.end_time <= server.end_time for t in tasks)
    assert server.attributes["rpc.system.name"] == "apache_thrift"
    assert (
        server.attributes["server.port"] > 0 and server.attributes["client.address"] == "127.0.0.1"
    )


def test_every_method_opens_a_server_span(start_service: StartService, spans: Any) -> None:
    _, client = start_service()
    assert client.ping() == "pong"
    client.panels()
    client.health()
    client.pool_stats()
    servers = {s.name: s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER}
    for method in ("ping", "panels", "health", "pool_stats"):
        span = servers[f"AppStats/{method}"]
        assert span.attributes["rpc.method"] == f"AppStats/{method}"
        assert span.attributes["network.transport"] == "tcp"
        assert span.attributes["network.peer.port"] > 0
    # Their arguments carry no trace context, so each is a root of its own.
    assert all(servers[f"AppStats/{m}"].parent is None for m in ("ping", "panels", "health"))


def test_client_spans_name_their_call_and_the_service(
    start_service: StartService, spans: Any
) -> None:
    _, client = start_service()
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    clients = [
        s
        for s in spans.get_finished_spans()
        if s.kind is SpanKind.CLIENT
        and format(s.context.trace_id, "032x") == response.trace_id
        and s.attributes.get("peer.service") != "fanout"
    ]
    by_name = {s.name: s.attributes["peer.service"] for s in clients}
    assert {name: service for name, service in by_name.items() if name.startswith("GET ")} == {
        "GET /apps/{app}/alerts": "alerts",
        "GET /apps/{app}/series/latency": "metrics",
        "GET /apps/{app}/series/volume": "metrics",
    }
    mongo = [s.name for s in clients if s.attributes["peer.service"] == "mongodb"]
    # Four Mongo panels over three collections: operation and collection in each name.
    assert sorted(mongo) == [
        "aggregate errors",
        "aggregate queries",
        "aggregate requests",
        "aggregate requests",
    ]
    http = [s for s in clients if s.name.startswith("GET ")]
    assert all(
        s.attributes["url.template"] == s.name[4:] and s.attributes["server.port"] > 0 for s in http
    )


def test_viewers_of_one_app_share_lookups_and_never_get_another_apps_data(
    start_service: StartService, slow_http: Callable[[int], SampleHttpServices], spans: Any
) -> None:
    http = slow_http(150)  # long enough that the viewers' calls overlap
    # Budgets that twelve viewers on a starved machine do not run out of: a panel cut by
    # its budget would be missing from the viewer's answer, which this compares whole.
    generous = {
        "fanout__task_timeout_ms": 10_000,
        "fanout__request_deadline_ms": 10_000,
        "http__read_timeout_ms": 10_000,
    }
    _, alone = start_service(http=http, **{"fanout__coalesce": False}, **generous)
    expected = {
        app: alone.get_app_stats(app, SAMPLE_START_MS, SAMPLE_END_MS).panels
        for app in ("shop", "search")
    }
    _, client = start_service(http=http, **generous)
    spans.clear()
    apps = ["shop", "search"] * 6
    viewers = [
        gevent.spawn(client.get_app_stats, app, SAMPLE_START_MS, SAMPLE_END_MS) for app in apps
    ]
    gevent.joinall(viewers, timeout=30, raise_error=True)
    for app, viewer in zip(apps, viewers):
        assert viewer.value.app == app and viewer.value.panels == expected[app]
    alerts_calls = [
        s
        for s in spans.get_finished_spans()
        if s.name == "GET /apps/{app}/alerts" and s.kind is SpanKind.CLIENT
    ]
    shared = [s for s in spans.get_finished_spans() if s.attributes.get("fanout.task.coalesced")]
    # Twelve viewers, two apps: far fewer calls than viewers, and at least one per app.
    assert 2 <= len(alerts_calls) < len(apps)
    assert len(shared) >= len(apps)
