"""request_span, task_span, mark_task_outcome and trace-context propagation, on the session provider."""

from __future__ import annotations

import gc
import json
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import gevent
import pymongo
import pytest
from gevent.pywsgi import WSGIServer
from opentelemetry import baggage, trace
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode, format_span_id, format_trace_id

from lookups.deadline import Deadline
from lookups.errors import LookupFailed
from lookups.mongo import first_batch
from tracing.context import MAX_HEADER_CHARS, extract_context, inject_headers, spawn_in_context
from tracing.spans import RPC_SERVICE, mark_task_outcome, request_span, task_span, trace_id_hex

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PANELS = ("errors", "urls", "controllers", "queries", "alerts", "latency", "volume")


def finished(spans, name: str) -> Any:
    """The one finished span named ``name`` (typed Any: a finished span's attributes,
    parent and events, optional in the SDK's types, are there)."""
    matches = [span for span in spans.get_finished_spans() if span.name == name]
    assert len(matches) == 1, [span.name for span in spans.get_finished_spans()]
    return matches[0]


def test_request_span_continues_the_callers_trace_from_injected_headers(spans) -> None:
    client_tracer = trace.get_tracer("web-tier")
    with client_tracer.start_as_current_span("web GET /dashboard", kind=SpanKind.CLIENT) as client:
        headers = inject_headers()
    with request_span("getStats", headers, "req-1"):
        pass
    server = finished(spans, "AppStats/getStats")
    assert server.kind is SpanKind.SERVER
    assert server.context.trace_id == client.get_span_context().trace_id
    assert server.parent.span_id == client.get_span_context().span_id
    assert server.parent.is_remote


def test_request_span_honours_a_literal_w3c_header_with_state_and_baggage(spans) -> None:
    headers = {
        "traceparent": TRACEPARENT,
        "tracestate": "congo=t61rcWkgMzE",
        "baggage": "tenant=acme",
    }
    with request_span("getStats", headers, "req-2") as span:
        assert trace.get_current_span() is span
        assert baggage.get_baggage("tenant") == "acme"
        assert trace_id_hex(span) == TRACE_ID
    assert baggage.get_baggage("tenant") is None
    server = finished(spans, "AppStats/getStats")
    assert format_span_id(server.parent.span_id) == PARENT_ID
    assert server.context.trace_state.get("congo") == "t61rcWkgMzE"


def test_request_span_without_headers_is_a_new_root_even_inside_another_span(spans) -> None:
    with trace.get_tracer("test").start_as_current_span("unrelated") as unrelated:
        with request_span("getStats", {}, "req-3") as span:
            assert trace_id_hex(span) != trace_id_hex(unrelated)
    assert finished(spans, "AppStats/getStats").parent is None


def test_request_span_attributes(spans) -> None:
    with request_span("getStats", {}, "req-4"):
        pass
    attributes = finished(spans, "AppStats/getStats").attributes
    assert attributes["rpc.system.name"] == "apache_thrift"
    assert attributes["rpc.method"] == f"{RPC_SERVICE}/getStats"
    assert "rpc.system" not in attributes and "rpc.service" not in attributes  # deprecated
    assert attributes["fanout.request_id"] == "req-4"


JUNK_HEADERS = [
    {"traceparent": "garbage"},
    {"traceparent": f"00-{'0' * 32}-{'0' * 16}-01"},
    {"traceparent": f"ff-{TRACE_ID}-{PARENT_ID}-01"},
    {"traceparent": TRACEPARENT + " " * MAX_HEADER_CHARS},
    {"traceparent": "x" * 1_000_000, "baggage": "%;=,;" * 100_000},
    {"traceparent": 12345, 6: "seven"},
    {"baggage": "===;;;,,,%%%"},
    {**{f"x-filler-{n}": "v" for n in range(10_000)}, "traceparent": TRACEPARENT},
]


@pytest.mark.parametrize("headers", JUNK_HEADERS, ids=range(len(JUNK_HEADERS)))
def test_junk_headers_give_a_fresh_root_never_an_exception(spans, headers) -> None:
    assert not trace.get_current_span(extract_context(headers)).get_span_context().is_valid
    with request_span("getStats", headers, "req-junk"):
        pass
    assert finished(spans, "AppStats/getStats").parent is None


def test_header_names_match_without_case_and_oversized_tracestate_is_dropped() -> None:
    context = extract_context(
        {"TraceParent": TRACEPARENT, "tracestate": "a=" + "b" * MAX_HEADER_CHARS}
    )
    span_context = trace.get_current_span(context).get_span_context()
    assert format_trace_id(span_context.trace_id) == TRACE_ID
    assert len(span_context.trace_state) == 0


def test_request_span_records_an_escaping_exception_and_reraises_it(spans) -> None:
    failure = ValueError("no such application")
    with pytest.raises(ValueError) as raised, request_span("getStats", {}, "req-5"):
        raise failure
    assert raised.value is failure
    server = finished(spans, "AppStats/getStats")
    assert server.status.status_code is StatusCode.ERROR
    assert [event.name for event in server.events] == ["exception"]


def test_request_span_lets_a_gevent_timeout_through_unrecorded(spans) -> None:
    with pytest.raises(gevent.Timeout), gevent.Timeout(0.01):
        with request_span("getStats", {}, "req-timeout"):
            gevent.sleep(5)
    server = finished(spans, "AppStats/getStats")
    assert server.events == () and server.status.status_code is StatusCode.UNSET


def run_tasks(spawn) -> None:
    def lookup(name: str) -> None:
        with task_span(name, "mongo", pool_wait_ms=1.456789123):
            gevent.sleep(0.01)

    with request_span("getStats", {}, "req-6"):
        gevent.joinall([spawn(lookup, name) for name in PANELS], timeout=10, raise_error=True)


def test_tasks_in_copied_context_are_siblings_under_the_request_span(spans) -> None:
    run_tasks(spawn_in_context)
    server = finished(spans, "AppStats/getStats")
    tasks = [finished(spans, f"fanout.task {name}") for name in PANELS]
    assert {task.parent.span_id for task in tasks} == {server.context.span_id}
    assert {task.context.trace_id for task in tasks} == {server.context.trace_id}
    assert all(task.kind is SpanKind.INTERNAL for task in tasks)
    attributes = tasks[0].attributes
    assert attributes["fanout.async"] is True
    assert attributes["fanout.task.name"] == "errors"
    assert attributes["fanout.task.source"] == "mongo"
    assert attributes["fanout.pool.wait_ms"] == 1.46  # rounded for a reader


def test_plain_gevent_spawn_loses_the_request_span(spans) -> None:
    # Trap 1: a new greenlet starts with an empty context, so its span is a root of a new trace.
    run_tasks(gevent.spawn)
    server = finished(spans, "AppStats/getStats")
    tasks = [finished(spans, f"fanout.task {name}") for name in PANELS]
    assert all(task.parent is None for task in tasks)
    assert server.context.trace_id not in {task.context.trace_id for task in tasks}


def test_task_span_passes_exceptions_through_and_marks_unmarked_spans(spans) -> None:
    failure = KeyError("panel")
    with pytest.raises(KeyError) as raised, task_span("errors", "mongo", 0):
        raise failure
    assert raised.value is failure
    with pytest.raises(gevent.Timeout), task_span("alerts", "http", 0), gevent.Timeout(0.01):
        gevent.sleep(5)
    errors, alerts = finished(spans, "fanout.task errors"), finished(spans, "fanout.task alerts")
    assert errors.attributes["fanout.task.status"] == "ERROR"
    assert errors.status.status_code is StatusCode.ERROR
    assert alerts.attributes["fanout.task.status"] == "TIMEOUT"


def test_killed_task_span_is_marked_cancelled(spans) -> None:
    def lookup() -> None:
        with task_span("latency", "http", 0):
            gevent.sleep(5)

    greenlet = spawn_in_context(lookup)
    gevent.sleep(0)
    greenlet.kill(timeout=5)
    assert finished(spans, "fanout.task latency").attributes["fanout.task.status"] == "CANCELLED"


def test_an_explicit_outcome_is_not_overwritten_by_the_escaping_exception(spans) -> None:
    with pytest.raises(RuntimeError), task_span("volume", "http", 0) as span:
        mark_task_outcome(span, "CANCELLED")
        raise RuntimeError("sibling failed")
    volume = finished(spans, "fanout.task volume")
    assert volume.attributes["fanout.task.status"] == "CANCELLED"
    assert volume.status.status_code is StatusCode.UNSET


def test_mark_task_outcome_records_the_error(spans) -> None:
    with task_span("queries", "mongo", 0) as span:
        mark_task_outcome(span, "ERROR", ValueError("bad pipeline"))
    queries = finished(spans, "fanout.task queries")
    assert queries.attributes["fanout.task.status"] == "ERROR"
    assert queries.status.description == "ValueError: bad pipeline"
    assert queries.events[0].attributes["exception.type"] == "ValueError"


def test_an_unsampled_call_whose_panel_failed_is_kept_whole_under_the_callers_trace(
    spans,
) -> None:
    """Tail capture (the default): the head sampler said no, the failed panel keeps it."""
    with request_span("getStats", {"traceparent": TRACEPARENT[:-2] + "00"}, "req-7") as span:
        with task_span("errors", "mongo", 0) as task:
            mark_task_outcome(task, "ERROR", ValueError("kept for this"))
        assert span.is_recording() and trace_id_hex(span) == TRACE_ID
    server, task_done = finished(spans, "AppStats/getStats"), finished(spans, "fanout.task errors")
    assert server.context.trace_id == int(TRACE_ID, 16) and server.parent.span_id == int(
        PARENT_ID, 16
    )
    assert task_done.parent.span_id == server.context.span_id
    assert task_done.attributes["fanout.task.status"] == "ERROR"
    assert server.context.trace_flags.sampled  # exported: marked sampled for the processors


def test_an_unsampled_ordinary_call_is_dropped_and_tells_the_next_service_it_is_unsampled(
    spans,
) -> None:
    with request_span("getStats", {"traceparent": TRACEPARENT[:-2] + "00"}, "req-7b") as span:
        with task_span("errors", "mongo", 0) as task:
            assert trace.get_current_span() is task
            headers = inject_headers()
            mark_task_outcome(task, "OK")
        assert trace_id_hex(span) == TRACE_ID
    assert headers["traceparent"].startswith(f"00-{TRACE_ID}-") and headers["traceparent"].endswith(
        "-00"
    )
    assert spans.get_finished_spans() == ()


class LookupBroke(Exception):
    """A project exception type: its event names it with its module."""


def fail_with_a_cause() -> None:
    empty: dict[str, int] = {}
    try:
        empty["missing"]
    except KeyError as error:
        raise LookupBroke("panel lookup broke") from error


def test_exception_event_carries_type_message_and_a_stack_trace_of_frames(spans) -> None:
    with pytest.raises(LookupBroke), request_span("getStats", {}, "req-10"):
        fail_with_a_cause()
    event = finished(spans, "AppStats/getStats").events[0]
    assert event.name == "exception"
    assert event.attributes["exception.type"] == f"{__name__}.LookupBroke"
    assert event.attributes["exception.message"] == "panel lookup broke"
    stack = event.attributes["exception.stacktrace"]
    # Cause first, then the exception, each with its frames (file, line, function), as Python prints them.
    assert (
        stack.index("KeyError: 'missing'")
        < stack.index("direct cause")
        < stack.index(f"{__name__}.LookupBroke: panel lookup broke")
    )
    assert f'File "{__file__}"' in stack and "in fail_with_a_cause" in stack
    assert 'empty["missing"]' not in stack  # no source lines: formatting them is what costs


def test_an_http_requests_exception_event_has_no_source_lines(spans) -> None:
    """An error escaping a lookup's HTTP client span is recorded without source lines."""
    from lookups.backends.http import HttpBackend
    from lookups.backends.settings import HttpBackendSettings

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        backend = HttpBackend(
            "alerts", HttpBackendSettings(url=f"http://127.0.0.1:{closed.getsockname()[1]}")
        )
        with request_span("getStats", {}, "req-refused"), task_span("alerts", "http", 0):
            with pytest.raises(LookupFailed):
                backend._get_body("alerts", backend._base + "/alerts", {}, "", Deadline.after_s(2))
        backend.close()
    (client,) = [span for span in spans.get_finished_spans() if span.kind == trace.SpanKind.CLIENT]
    (event,) = [event for event in client.events if event.name == "exception"]
    stack = event.attributes["exception.stacktrace"]
    assert event.attributes["exception.type"] == "requests.exceptions.ConnectionError"
    assert 'File "' in stack and ", in send" in stack
    # Source lines follow their frame's line, indented by four spaces, in format_exception.
    assert not any(line.startswith("    ") for line in stack.splitlines()), stack[:1500]


def test_an_ended_span_is_freed_at_once_not_by_the_collector(spans) -> None:
    """The exception recorder each span gets holds it weakly: no span is a reference
    cycle, so reference counting frees it, attributes and all, when it is dropped."""
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(LookupBroke), request_span("getStats", {}, "req-freed") as span:
            alive = weakref.ref(span)
            fail_with_a_cause()
        del span
        assert alive() is None
    finally:
        gc.enable()
    (event,) = finished(spans, "AppStats/getStats").events  # recorded through the weak proxy
    assert event.attributes["exception.type"] == f"{__name__}.LookupBroke"


def test_trace_id_hex() -> None:
    assert trace_id_hex(INVALID_SPAN) == ""
    with trace.get_tracer("test").start_as_current_span("probe") as span:
        text = trace_id_hex(span)
    assert (
        len(text) == 32
        and text == text.lower()
        and int(text, 16) == span.get_span_context().trace_id
    )


@pytest.fixture
def echo_server() -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 that answers with the headers it received."""

    def application(environ, start_response):
        seen = {"traceparent": environ.get("HTTP_TRACEPARENT", "")}
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(seen).encode()]

    server = WSGIServer(("127.0.0.1", 0), application, log=None, error_log=None)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/alerts"
    finally:
        server.stop(timeout=2)


def test_requests_spans_nest_under_the_task_span_and_carry_the_trace_onwards(
    spans, echo_server
) -> None:
    from lookups.backends.http import HttpBackend
    from lookups.backends.settings import HttpBackendSettings

    backend = HttpBackend("alerts", HttpBackendSettings(url=echo_server.rsplit("/", 1)[0]))

    def lookup() -> dict[str, Any]:
        with task_span("alerts", "http", 0):
            body = backend._get_body("alerts", echo_server, {}, "", Deadline.after_s(5))
            return dict(json.loads(body))

    with request_span("getStats", {"traceparent": TRACEPARENT}, "req-8"):
        seen = spawn_in_context(lookup).get(timeout=10)
    task = finished(spans, "fanout.task alerts")
    clients = [span for span in spans.get_finished_spans() if span.kind is SpanKind.CLIENT]
    assert len(clients) == 1
    assert clients[0].parent.span_id == task.context.span_id
    assert seen["traceparent"].split("-")[1:3] == [
        TRACE_ID,
        format_span_id(clients[0].context.span_id),
    ]


def test_an_unsampled_call_passes_its_trace_on_and_keeps_its_http_span_if_kept(spans) -> None:
    """The requests instrumentation's span is recorded with the call: an ordinary call
    drops it, a call whose panel failed exports it under its task span."""
    from lookups.backends.http import HttpBackend
    from lookups.backends.settings import HttpBackendSettings
    from lookups.http import AlertsLookup
    from lookups.panels import Window

    seen: list[str] = []

    def alerts_service(environ, start_response):
        seen.append(environ.get("HTTP_TRACEPARENT", ""))
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b'{"alerts": []}']

    server = WSGIServer(("127.0.0.1", 0), alerts_service, log=None, error_log=None)
    server.start()
    lookup = AlertsLookup(
        HttpBackend("alerts", HttpBackendSettings(url=f"http://127.0.0.1:{server.server_port}"))
    )

    def fetch(status: str) -> Any:
        with task_span("alerts", "http", 0) as task:
            value = lookup.fetch(Window("shop", 1_000, 2_000), Deadline.after_s(5.0))
            mark_task_outcome(task, status)
            return value

    try:
        for status in ("OK", "ERROR"):
            with request_span("getStats", {"traceparent": TRACEPARENT[:-2] + "00"}, "req-8b"):
                assert spawn_in_context(fetch, status).get(timeout=10).alerts == ()
    finally:
        server.stop(timeout=2)
    assert [t.split("-")[1] for t in seen] == [TRACE_ID, TRACE_ID]
    assert all(t.endswith("-00") for t in seen)  # the head sampler's decision travels on
    client = [span for span in spans.get_finished_spans() if span.kind == trace.SpanKind.CLIENT]
    assert len(client) == 1  # the ordinary call's was dropped with it
    task_done = finished(spans, "fanout.task alerts")
    assert client[0].parent.span_id == task_done.context.span_id
    assert f"-{client[0].context.span_id:016x}-" in seen[1]  # the id the service was told


def test_mongodb_command_spans_nest_under_the_task_span(spans, mongo_server) -> None:
    """Our own command spans (``tracing.mongo_spans = "own"``, the default)."""

    def lookup() -> int:
        with task_span("errors", "mongo", 0):
            return len(first_batch(client["apm"], "errors", [{"$count": "n"}], 10)[0])

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        mongo_server.uri, connectTimeoutMS=5000, socketTimeoutMS=5000, serverSelectionTimeoutMS=5000
    )
    try:
        with request_span("getStats", {}, "req-9"):
            spawn_in_context(lookup).get(timeout=10)
    finally:
        client.close()
    task = finished(spans, "fanout.task errors")
    # client.close() sends endSessions outside any request: a root of its own, left out here.
    commands = [
        span
        for span in spans.get_finished_spans()
        if span.kind is SpanKind.CLIENT and span.parent is not None
    ]
    # Named by operation and collection (tracing.clients), as the pymongo instrumentation's are.
    assert [span.name for span in commands] == ["aggregate errors"]
    command = commands[0]
    assert command.parent.span_id == task.context.span_id
    assert command.attributes["db.collection.name"] == "errors"
    assert command.attributes["db.system.name"] == "mongodb"
    assert command.attributes["peer.service"] == "mongodb"
    assert (command.attributes["server.address"], command.attributes["server.port"]) == (
        "127.0.0.1",
        mongo_server.port,
    )
    # The client's first connection was opened in the task: its set-up shows on the task span.
    events = {event.name: event for event in task.events}
    assert "mongodb.connection.created" in events
    assert events["mongodb.connection.ready"].attributes["duration_ms"] >= 0
