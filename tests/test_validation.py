"""Request validation: every bad field raises InvalidRequest naming it, under an ERROR span."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import SpanKind, StatusCode
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TClient
from thriftpy2.transport import TCyFramedTransport, TSocket

from service.app import FanOutService
from service.engine.settings import FanOutSettings
from service.idl import appstats
from service.rpc.validation import validate_stats_request
from service.settings.config import load_settings
from tests.support.samples import backend_overrides
from tracing.context import inject_headers

KNOWN = ("errors", "urls", "alerts")
DAY_MS = 24 * 3600 * 1000


def request(**fields: Any) -> Any:
    base = dict(app="shop", start_ms=1_000, end_ms=1_000 + DAY_MS)
    base.update(fields)
    return appstats.StatsRequest(**base)


def validate(req: Any, default: tuple[str, ...] = KNOWN) -> Any:
    return validate_stats_request(req, KNOWN, default, FanOutSettings(request_deadline_ms=2000))


def test_a_good_request_becomes_trusted_values() -> None:
    valid = validate(
        request(
            panels=["alerts", "errors"],
            meta=appstats.RequestMeta(
                deadline_ms=500,
                request_id="abc-1",
                headers={
                    "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
                    "Cookie": "secret",
                },
            ),
        )
    )
    assert (valid.window.app, valid.window.start_ms, valid.window.end_ms) == (
        "shop",
        1_000,
        1_000 + DAY_MS,
    )
    assert valid.panels == ("alerts", "errors")
    assert valid.deadline_ms == 500 and valid.request_id == "abc-1"
    assert set(valid.headers) == {"traceparent"}  # nothing but propagation headers is kept


def test_defaults_all_offered_panels_and_server_deadline() -> None:
    valid = validate(request(), default=("errors", "urls"))
    assert valid.panels == ("errors", "urls")
    assert valid.deadline_ms == 2000
    assert validate(request(meta=appstats.RequestMeta(deadline_ms=60_000))).deadline_ms == 2000


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(app=""), "app"),
        (dict(app=None), "app"),
        (dict(app="x" * 65), "app"),
        (dict(app="shop/../admin"), "app"),
        (dict(app='{"$ne": 1}'), "app"),
        (dict(app="-leading-dash"), "app"),
        (dict(start_ms=None), "start_ms"),
        (dict(start_ms=-1), "start_ms"),
        (dict(start_ms=2**62, end_ms=2**62 + 1), "start_ms"),
        (dict(end_ms=500), "end_ms"),
        (dict(end_ms=1_000), "end_ms"),
        (dict(end_ms=1_000 + 40 * DAY_MS), "end_ms"),
        (dict(panels=[]), "panels"),
        (dict(panels=["errors", "nope"]), "panels"),
        (dict(panels=["errors", "errors"]), "panels"),
        (dict(panels=["errors"] * 10), "panels"),
        (dict(meta=appstats.RequestMeta(deadline_ms=0)), "meta.deadline_ms"),
        (dict(meta=appstats.RequestMeta(deadline_ms=-5)), "meta.deadline_ms"),
        (dict(meta=appstats.RequestMeta(deadline_ms=2**31 - 1)), "meta.deadline_ms"),
        (dict(meta=appstats.RequestMeta(request_id="has space")), "meta.request_id"),
        (
            dict(meta=appstats.RequestMeta(headers={f"h{i}": "v" for i in range(100)})),
            "meta.headers",
        ),
        (dict(meta=appstats.RequestMeta(headers={"traceparent": "x" * 10_000})), "meta.headers"),
    ],
)
def test_bad_fields_are_named(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(appstats.InvalidRequest) as caught:
        validate(request(**fields))
    assert caught.value.field == field
    assert caught.value.message.startswith(field + ":")


def test_missing_request_is_invalid() -> None:
    with pytest.raises(appstats.InvalidRequest) as caught:
        validate(None)
    assert caught.value.field == "request"


class _B3Single(TextMapPropagator):
    """A stand-in for a configured non-W3C propagator: only its field names matter here."""

    def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
        return context

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        return None

    @property
    def fields(self) -> set[str]:
        return {"b3"}


def test_headers_of_the_configured_propagators_are_kept() -> None:
    original = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([original, _B3Single()]))
    try:
        valid = validate(
            request(meta=appstats.RequestMeta(headers={"B3": "a-b-1", "x-other": "1"}))
        )
    finally:
        propagate.set_global_textmap(original)
    assert dict(valid.headers) == {"b3": "a-b-1"}


HOUR_MS = 3600 * 1000


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(app="a" * 100_000), "app"),  # huge
        (dict(app="shop\x00"), "app"),
        (dict(start_ms=5_000, end_ms=4_999), "end_ms"),  # start after end
        (dict(start_ms=1_000, end_ms=1_000 + HOUR_MS + 1), "end_ms"),  # over max_window_ms
        (dict(panels=["x" * 60_000]), "panels"),  # unknown, huge
        (dict(meta=appstats.RequestMeta(deadline_ms=600_001)), "meta.deadline_ms"),
        (dict(meta=appstats.RequestMeta(deadline_ms=-(2**31))), "meta.deadline_ms"),
        (dict(meta=appstats.RequestMeta(request_id="r" * 65)), "meta.request_id"),
        (dict(meta=appstats.RequestMeta(headers={"traceparent": 7})), "meta.headers"),
    ],
)
def test_each_invalid_argument_names_its_field(fields: dict[str, Any], field: str) -> None:
    settings = FanOutSettings(request_deadline_ms=2000, max_window_ms=HOUR_MS)
    with pytest.raises(appstats.InvalidRequest) as caught:
        validate_stats_request(
            request(**{"end_ms": 1_000 + HOUR_MS, **fields}), KNOWN, KNOWN, settings
        )
    assert caught.value.field == field
    assert len(caught.value.message) < 300  # a huge value is never echoed back whole


def test_limits_are_inclusive() -> None:
    settings = FanOutSettings(request_deadline_ms=2000, max_window_ms=HOUR_MS)
    valid = validate_stats_request(
        request(
            app="a" * 64,
            start_ms=0,
            end_ms=HOUR_MS,
            meta=appstats.RequestMeta(deadline_ms=600_000, request_id="r" * 64),
        ),
        KNOWN,
        KNOWN,
        settings,
    )
    assert valid.window.end_ms - valid.window.start_ms == HOUR_MS
    assert valid.deadline_ms == 2000  # capped by the server's own deadline


@pytest.mark.parametrize(
    "app, start_ms, end_ms, deadline_ms, field",
    [
        ("", 1_000, 2_000, 1_000, "app"),
        ("shop", 2_000, 1_000, 1_000, "end_ms"),
        ("shop", 1_000, 2_000, 0, "meta.deadline_ms"),
    ],
)
def test_an_invalid_request_gets_an_error_span_naming_the_field(
    mongo_server: Any,
    http_services: Any,
    spans: Any,
    app: str,
    start_ms: int,
    end_ms: int,
    deadline_ms: int,
    field: str,
) -> None:
    overrides = {**backend_overrides(mongo_server, http_services), "server.port": 0}
    service = FanOutService(load_settings(env={}, overrides=overrides)).start()
    transport = TCyFramedTransport(TSocket(*service.address, socket_timeout=5000))
    transport.open()
    try:
        client = TClient(appstats.AppStats, TCyBinaryProtocol(transport))
        with trace.get_tracer("test").start_as_current_span("caller") as caller:
            meta = appstats.RequestMeta(headers=inject_headers(), deadline_ms=deadline_ms)
            with pytest.raises(appstats.InvalidRequest) as caught:
                client.get_app_stats(
                    appstats.StatsRequest(app=app, start_ms=start_ms, end_ms=end_ms, meta=meta)
                )
    finally:
        transport.close()
        service.stop()
    assert caught.value.field == field
    server_spans = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.name for s in server_spans] == ["AppStats/get_app_stats"]
    span = server_spans[0]
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["fanout.invalid_field"] == field
    # The caller's trace context is honoured although the request is invalid.
    assert span.parent is not None and span.parent.span_id == caller.get_span_context().span_id
    assert span.context.trace_id == caller.get_span_context().trace_id
