"""The web tier's client against a real in-process server: pool, deadlines, trace context, errors."""

from __future__ import annotations

import socket
import time
from typing import Any

import gevent
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from service.client import REPLY_MARGIN_MS, AppStatsClient
from service.idl import appstats
from tests.support.server import COMBINATIONS, sample_response
from tests.support.sockets import wait_for

_tracer = trace.get_tracer(__name__)


def client_for(server: Any, **options: Any) -> AppStatsClient:
    host, port = server.address
    return AppStatsClient(host, port, **options)


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_round_trip_on_every_transport_and_protocol(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)
    with client_for(server, transport=transport, protocol=protocol) as client:
        assert client.ping() == "pong"
        assert client.panels() == ["alerts", "errors", "latency", "urls"]
        assert client.get_app_stats("shop", 1_000, 2_000, ["errors"]) == sample_response("shop")
    assert server.stats.connections_total == 1


def test_deadline_request_id_and_trace_context_reach_the_server(start_server, handler, spans):
    server = start_server()
    with client_for(server) as client, _tracer.start_as_current_span("web request") as caller:
        client.get_app_stats("shop", 1_000, 2_000, deadline_ms=1_500, request_id="req-42")

    meta = handler.requests[-1].meta
    assert 0 < meta.deadline_ms <= 1_500
    assert meta.request_id == "req-42"
    version, trace_id, parent_id, flags = meta.headers["traceparent"].split("-")
    assert trace_id == format_trace_id(caller.get_span_context().trace_id)
    client_span = next(span for span in spans.get_finished_spans() if span.kind == SpanKind.CLIENT)
    # The server's span will be a child of the client span, itself a child of the caller's.
    assert parent_id == format_span_id(client_span.context.span_id)
    assert client_span.parent.span_id == caller.get_span_context().span_id
    assert client_span.attributes["rpc.system.name"] == "apache_thrift"
    assert client_span.attributes["rpc.method"] == "AppStats/get_app_stats"


def test_default_deadline_is_the_client_timeout(start_server, handler):
    server = start_server()
    with client_for(server, timeout_ms=800) as client:
        client.get_app_stats("shop", 1_000, 2_000)
    assert 0 < handler.requests[-1].meta.deadline_ms <= 800
    assert handler.requests[-1].panels is None


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_slow_server_past_the_deadline_raises_a_timeout_promptly(start_server, transport):
    server = start_server(transport=transport)
    with client_for(server, transport=transport, timeout_ms=30_000) as client:
        started = time.monotonic()
        with pytest.raises(TTransportException) as caught:
            client.get_app_stats("slow", 1_000, 2_000, deadline_ms=200)
        assert caught.value.type == TTransportException.TIMED_OUT
        assert time.monotonic() - started < (200 + REPLY_MARGIN_MS) / 1000 + 2.0

        # The timed-out connection is discarded; a fresh one answers the next call.
        assert client.get_app_stats("shop", 1_000, 2_000) == sample_response("shop")
    assert server.stats.connections_total == 2


def test_pool_never_exceeds_its_size(start_server, handler):
    server = start_server()
    with client_for(server, pool_size=2) as client:
        calls = [gevent.spawn(client.get_app_stats, "slow", 1_000, 2_000) for _ in range(6)]
        wait_for(lambda: handler.active == 2)
        gevent.wait(calls, timeout=0.3)  # give any third connection time to show up
        assert handler.active == 2
        assert server.stats.connections_open == 2

        handler.released.set()
        assert [call.get(timeout=5) for call in calls] == [sample_response("slow")] * 6
    assert handler.max_active == 2
    assert server.stats.connections_total == 2


def test_waiting_for_a_pooled_connection_is_bounded_by_the_deadline(start_server, handler):
    server = start_server()
    with client_for(server, pool_size=1) as client:
        busy = gevent.spawn(client.get_app_stats, "slow", 1_000, 2_000)
        assert handler.entered.wait(timeout=5)
        with pytest.raises(TTransportException) as caught:
            client.get_app_stats("shop", 1_000, 2_000, deadline_ms=100)
        assert caught.value.type == TTransportException.TIMED_OUT
        handler.released.set()
        assert busy.get(timeout=5) == sample_response("slow")


def test_a_connection_the_server_closed_is_discarded_and_the_call_retried_on_a_new_one(
    start_server,
):
    server = start_server(idle_timeout_ms=100)
    with client_for(server) as client:
        assert client.ping() == "pong"
        # The server idles the pooled connection out from under the client.
        wait_for(lambda: server.stats.connections_open == 0)

        assert client.ping() == "pong"  # failed on the dead connection, retried on a new one
        assert client.ping() == "pong"  # and the new one is pooled
    assert server.stats.connections_total == 2


def test_declared_and_internal_errors_keep_the_connection(start_server):
    server = start_server()
    with client_for(server) as client:
        with pytest.raises(appstats.InvalidRequest) as invalid:
            client.get_app_stats("", 1_000, 2_000)
        assert invalid.value.field == "app"
        with pytest.raises(TApplicationException) as internal:
            client.get_app_stats("internal", 1_000, 2_000)
        assert internal.value.type == TApplicationException.INTERNAL_ERROR
        assert client.ping() == "pong"
    assert server.stats.connections_total == 1


def test_closed_client_refuses_calls(start_server):
    server = start_server()
    client = client_for(server)
    assert client.ping() == "pong"
    client.close()
    with pytest.raises(TTransportException) as caught:
        client.ping()
    assert caught.value.type == TTransportException.NOT_OPEN


def test_unreachable_server_fails_within_the_connect_timeout():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]  # bound but not listening: connections are refused
        with AppStatsClient("127.0.0.1", port, connect_timeout_ms=500) as client:
            with pytest.raises(TTransportException) as caught:
                client.ping()
    assert caught.value.type == TTransportException.NOT_OPEN


@pytest.mark.parametrize(
    "option,value",
    [("transport", "http"), ("protocol", "json"), ("pool_size", 0), ("timeout_ms", 0)],
)
def test_bad_options_raise(option, value):
    with pytest.raises(ValueError):
        AppStatsClient("127.0.0.1", 9, **{option: value})
