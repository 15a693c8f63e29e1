"""Tail capture (tracing/capture.py): real ``fanout serve`` processes exporting OTLP to a real
receiver. A call kept by its tail is the trace a 100%-sampled call makes; calls are kept for
a failed, cut or refused panel and dropped when ordinary; the ceiling holds. The rules
themselves are pure, and tested as such at the end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import gevent
import pytest

from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData, SampleHttpServices
from service.testing import FakeClock
from tests.support.otlp_receiver import OtlpReceiver
from tracing.capture_rules import KeepRules, KeptPerSecond, RecentQuantile, keep_reason

PARENT_ID = "00f067aa0ba902b7"
#: Attributes that differ between two servers or two calls by nature.
_VOLATILE = {
    "server.port",
    "client.port",
    "network.peer.port",
    "fanout.request_id",
    "fanout.pool.wait_ms",
}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def _exporting(receiver: OtlpReceiver, **settings: Any) -> dict[str, Any]:
    return {
        "env": {"OTEL_BSP_SCHEDULE_DELAY": "50"},
        "tracing.exporter": "otlp",
        "tracing.endpoint": receiver.endpoint,
        **settings,
    }


def _call(port: int, trace_id: str, sampled: bool, deadline_ms: int = 5000) -> Any:
    request = appstats.StatsRequest(
        app="shop",
        start_ms=SAMPLE_START_MS,
        end_ms=SAMPLE_END_MS,
        meta=appstats.RequestMeta(
            headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-{'01' if sampled else '00'}"},
            deadline_ms=deadline_ms,
        ),
    )
    client = AppStatsClient("127.0.0.1", port, overload_retry_ratio=0, timeout_ms=10_000)
    try:
        return client._call("get_app_stats", deadline_ms + 1000, lambda _: (request,))
    finally:
        client.close()


def _call_invalid(port: int, times: int) -> None:
    """``times`` calls answered ``InvalidRequest`` (an empty app): each is kept as an error."""
    bad = appstats.StatsRequest(app="", start_ms=1, end_ms=0)
    client = AppStatsClient("127.0.0.1", port, overload_retry_ratio=0)
    try:
        for _ in range(times):
            with pytest.raises(appstats.InvalidRequest):
                client._call("get_app_stats", 2000, lambda _: (bad,))
    finally:
        client.close()


def _shape(spans: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """A trace without its ids, times and per-server values: what a reader compares."""
    by_id = {span["span_id"]: span for span in spans}

    def parent(span: dict[str, Any]) -> str:
        above = by_id.get(span["parent_span_id"])
        return above["name"] if above else f"remote {span['parent_span_id']}"

    return sorted(
        (
            span["name"],
            span["kind"],
            parent(span),
            tuple(sorted((k, str(v)) for k, v in span["attributes"].items() if k not in _VOLATILE)),
            tuple(e for e in span["events"] if not e.startswith("mongodb.connection")),
            span["status"],
            span["links"],
        )
        for span in spans
    )


def _trace(receiver: OtlpReceiver, trace_id: str, count: int) -> list[dict[str, Any]]:
    return [
        span
        for span in receiver.wait_for(
            lambda spans: sum(s["trace_id"] == trace_id for s in spans) >= count
        )
        if span["trace_id"] == trace_id
    ]


def test_a_call_kept_by_its_tail_is_the_trace_a_fully_sampled_call_makes(
    serve: Any, http_services: SampleHttpServices, receiver: OtlpReceiver
) -> None:
    sampled = serve(http_services, **_exporting(receiver, **{"tracing.tail_capture": "false"}))
    # Unsampled at the head, every call slower than 1 ms: each is kept by its tail.
    tail = serve(
        http_services,
        **_exporting(receiver, **{"tracing.sample_ratio": "0", "tracing.tail_slow_ms": "1"}),
    )
    shapes = []
    for server, sampled_head in ((sampled, True), (tail, False)):
        for number in range(2):  # the second call's connections are warm on both
            trace_id = f"{number + 1:02d}{'a' if sampled_head else 'b'}" + "0" * 29
            answer = _call(server.port, trace_id, sampled_head)
            assert answer.trace_id == trace_id
            assert [o.status for o in answer.outcomes] == [appstats.TaskStatus.OK] * 7
        spans = _trace(receiver, trace_id, 15)
        assert {span["parent_span_id"] for span in spans if span["kind"] == 2} == {PARENT_ID}
        shapes.append(_shape(spans))
    assert len(shapes[0]) >= 15  # the SERVER span, 7 tasks, MongoDB commands, HTTP requests
    assert shapes[1] == shapes[0]


@pytest.fixture
def slow_alerts(sample_data: SampleData) -> Iterator[SampleHttpServices]:
    with SampleHttpServices(sample_data, alerts_delay_ms=1500) as services:
        yield services


def test_a_cut_panel_or_a_refusal_keeps_the_call_and_an_ordinary_one_is_dropped(
    serve: Any, slow_alerts: SampleHttpServices, receiver: OtlpReceiver
) -> None:
    server = serve(
        slow_alerts,
        **_exporting(receiver, **{"tracing.sample_ratio": "0", "tracing.tail_slow_ms": "60000"}),
    )
    ordinary, cut = "c" * 32, "d" * 32
    first = _call(server.port, ordinary, sampled=False, deadline_ms=4000)
    assert all(o.status == appstats.TaskStatus.OK for o in first.outcomes)
    answer = _call(server.port, cut, sampled=False, deadline_ms=800)  # alerts answers late
    statuses = {o.name: o.status for o in answer.outcomes}
    assert statuses["alerts"] == appstats.TaskStatus.TIMEOUT and answer.trace_id == cut
    _call_invalid(server.port, 1)
    kept = _trace(receiver, cut, 8)
    cut_task = next(s for s in kept if s["name"] == "fanout.task alerts")
    assert cut_task["attributes"]["fanout.task.status"] == "TIMEOUT"
    errors = receiver.wait_for(
        lambda spans: any(s["attributes"].get("fanout.invalid_field") for s in spans)
    )
    time.sleep(0.5)  # a batch the ordinary call's spans would be in has gone
    assert not any(span["trace_id"] == ordinary for span in receiver.spans)
    assert errors


@pytest.fixture
def late_alerts(sample_data: SampleData) -> Iterator[SampleHttpServices]:
    with SampleHttpServices(sample_data, alerts_delay_ms=LATE_ALERTS_MS) as services:
        yield services


LATE_ALERTS_MS = 300
#: Calls at once, and calls in all: half of them with a deadline the late alerts miss.
CALLERS, CALLS = 6, 60


def test_every_call_not_answered_whole_is_exported_whole_and_no_other(
    serve: Any, late_alerts: SampleHttpServices, receiver: OtlpReceiver
) -> None:
    """Under load, every call with a panel not OK is exported, with its SERVER span and a
    task span for every panel, and no call answered whole is: the trace ids exported are
    exactly the ids of the answers not whole (whichever panels a busy machine cut)."""
    server = serve(
        late_alerts,
        **_exporting(
            receiver,
            **{
                "tracing.sample_ratio": "0",
                "tracing.tail_slow_ms": "60000",
                "tracing.tail_max_per_s": "10000",
            },
        ),
    )
    answers: dict[str, Any] = {}
    numbers = iter(range(CALLS))

    def caller() -> None:
        for number in numbers:
            trace_id = f"{number + 1:032x}"
            deadline_ms = LATE_ALERTS_MS // 2 if number % 2 else 5000
            answers[trace_id] = _call(server.port, trace_id, False, deadline_ms)

    gevent.joinall([gevent.spawn(caller) for _ in range(CALLERS)], raise_error=True)
    not_whole = {
        trace_id
        for trace_id, answer in answers.items()
        if any(o.status != appstats.TaskStatus.OK for o in answer.outcomes)
    }
    assert len(answers) == CALLS and len(not_whole) >= CALLS // 2

    def exported(spans: list[dict[str, Any]]) -> set[str]:
        return {span["trace_id"] for span in spans if span["kind"] == 2}  # SERVER

    receiver.wait_for(lambda spans: exported(spans) >= not_whole)
    time.sleep(0.5)  # a batch a call answered whole would be in has gone
    assert exported(receiver.spans) == not_whole
    for trace_id in not_whole:
        tasks = {s["name"] for s in receiver.spans if s["trace_id"] == trace_id and s["kind"] == 1}
        assert {f"fanout.task {o.name}" for o in answers[trace_id].outcomes} <= tasks


def test_kept_calls_past_the_ceiling_are_dropped(
    serve: Any, http_services: SampleHttpServices, receiver: OtlpReceiver
) -> None:
    server = serve(
        http_services,
        **_exporting(receiver, **{"tracing.sample_ratio": "0", "tracing.tail_max_per_s": "2"}),
    )
    began = time.monotonic()
    _call_invalid(server.port, 30)
    took_s = time.monotonic() - began
    receiver.wait_for(lambda spans: len(spans) >= 2)
    time.sleep(0.5)
    kept = [s for s in receiver.spans if s["attributes"].get("fanout.invalid_field") is not None]
    assert 2 <= len(kept) <= 2 + int(took_s * 2) + 1, (len(kept), took_s)


class _Span:
    """What keep_reason reads of a recorded span."""

    name: str
    attributes: dict[str, Any]
    start_time: int
    end_time: int | None
    status: Any

    def __init__(
        self,
        name: str,
        attributes: dict[str, Any] | None = None,
        seconds: float = 0.1,
        failed: bool = False,
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.name, self.attributes = name, attributes or {}
        self.start_time, self.end_time = 0, int(seconds * 1e9)
        self.status = Status(StatusCode.ERROR if failed else StatusCode.UNSET)


def _rules(**kwargs: Any) -> KeepRules:
    return KeepRules(**{"slow_ms": 0, "quantile": 0.99, "max_per_s": 0, **kwargs})


def test_the_first_reason_that_applies_keeps_a_call() -> None:
    root = _Span("AppStats/get_app_stats")
    task = _Span("fanout.task urls", {"fanout.task.status": "OK"})
    assert keep_reason([task, root], root, sampled=False, rules=_rules()) is None
    assert keep_reason([task, root], root, sampled=True, rules=_rules()) == "sampled"
    for status, reason in (("ERROR", "panel"), ("TIMEOUT", "cut"), ("CANCELLED", "cut")):
        failed = _Span("fanout.task urls", {"fanout.task.status": status})
        assert keep_reason([failed, root], root, sampled=True, rules=_rules()) == reason
    shed = _Span("t", {"fanout.task.status": "SKIPPED", "fanout.task.skip_reason": "brownout"})
    off = _Span("t", {"fanout.task.status": "SKIPPED", "fanout.task.skip_reason": "disabled"})
    assert keep_reason([shed, root], root, False, _rules()) == "shed"
    assert keep_reason([off, root], root, False, _rules()) is None
    refused = _Span("AppStats/get_app_stats", failed=True)
    assert keep_reason([refused], refused, False, _rules()) == "error"
    slow = _Span("AppStats/get_app_stats", seconds=0.3)
    assert keep_reason([slow], slow, False, _rules(slow_ms=250)) == "slow"
    assert keep_reason([root], root, False, _rules(slow_ms=250)) is None


def test_the_slow_threshold_is_the_recent_quantile_once_enough_calls_are_seen() -> None:
    recent = RecentQuantile(0.99)
    for number in range(RecentQuantile.LEAST - 1):
        recent.add(0.01 + number * 1e-4)
    assert recent.value is None  # too few to say
    rules = _rules()
    for _ in range(RecentQuantile.WINDOW):
        assert not rules.slow("m", 0.010)
    assert rules.slow("m", 0.020) and not rules.slow("m", 0.010)
    for _ in range(RecentQuantile.WINDOW):  # the method slowed for good: that is its norm
        rules.slow("m", 0.050)
    assert not rules.slow("m", 0.040)
    assert not rules.slow("other", 10.0)  # a method of its own, none seen yet


def test_the_ceiling_refills_at_its_rate() -> None:
    clock = FakeClock()
    ceiling = KeptPerSecond(2, clock)
    assert [ceiling.take() for _ in range(3)] == [True, True, False]
    clock.advance(0.5)
    assert [ceiling.take() for _ in range(2)] == [True, False]
    clock.advance(10)
    assert [ceiling.take() for _ in range(3)] == [True, True, False]
    assert all(KeptPerSecond(0, clock).take() for _ in range(100))  # 0: no ceiling
