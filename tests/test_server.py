"""The evented Thrift server over real sockets: transports, bounds, errors, back-pressure, stop."""

from __future__ import annotations

import logging
import re
import socket
import struct
import time
from typing import Any

import gevent
import pytest
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.thrift import TApplicationException, TClient, TMessageType, TProcessor
from thriftpy2.transport import TSocket
from thriftpy2.transport.buffered import TCyBufferedTransport
from thriftpy2.transport.framed import TCyFramedTransport

from service.client import AppStatsClient
from service.idl import appstats
from service.listener.server import ThriftServer
from service.settings.server import ServerSettings
from service.wire.channel import FramedChannel, FrameRejected, MessageRejected
from service.wire.channels import BufferedChannel, protocol_for
from tests.support.server import (
    COMBINATIONS,
    SECRET,
    RecordingHandler,
    read_until_closed,
    sample_response,
)
from tests.support.sockets import raw_connection, wait_for
from tests.support.thrift_calls import encode_call, frame, thrift_client


def request(app: str) -> Any:
    return appstats.StatsRequest(app=app, start_ms=1_000, end_ms=2_000, panels=["errors", "urls"])


def truncated_call(protocol: str) -> bytes:
    """A get_app_stats call cut inside its ``app`` string: the struct claims more than it holds."""
    app = "A" * 300
    call = encode_call(
        "get_app_stats", appstats.AppStats.get_app_stats_args(request=request(app)), protocol
    )
    return call[: call.index(app.encode()) + 10]


def call_with_string_length(claimed: int) -> bytes:
    """A binary get_app_stats call whose ``app`` string declares ``claimed`` bytes but holds 4."""
    call = encode_call(
        "get_app_stats", appstats.AppStats.get_app_stats_args(request=request("AAAA"))
    )
    start = call.index(b"AAAA")
    return call[: start - 4] + struct.pack("!i", claimed) + call[start:]


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_round_trip_on_every_transport_and_protocol(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)
    client = thrift_client(server, transport, protocol)

    assert client.ping() == "pong"
    assert client.panels() == ["alerts", "errors", "latency", "urls"]
    assert client.get_app_stats(request("shop")) == sample_response("shop")
    assert server.stats.connections_total == 1


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_message_larger_than_the_read_buffer_round_trips(start_server, transport, protocol):
    # Past the 16 KiB read-ahead and the default 64 KiB string limit, well under the frame limit.
    server = start_server(transport=transport, protocol=protocol, max_string_bytes=200_000)
    client = thrift_client(server, transport, protocol)
    app = "a" * 100_000

    assert client.get_app_stats(request(app)).app == app
    assert client.ping() == "pong"


def test_pipelined_frames_are_answered_in_order(start_server):
    server = start_server()
    calls = [
        encode_call("ping", appstats.AppStats.ping_args()),
        encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(request=request("x"))),
        encode_call("panels", appstats.AppStats.panels_args()),
    ]
    with raw_connection(server) as sock:
        sock.sendall(b"".join(frame(call) for call in calls))
        client = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(sock))))

        assert client._recv("ping") == "pong"
        assert client._recv("get_app_stats") == sample_response("x")
        assert client._recv("panels") == ["alerts", "errors", "latency", "urls"]


def test_frames_straddling_the_read_buffer_are_reassembled(start_server):
    server = start_server()
    apps = [f"{index}" * 5_000 for index in range(10)]  # ~50 kB in one burst
    calls = [
        encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(request=request(app)))
        for app in apps
    ]
    with raw_connection(server) as sock:
        sock.sendall(b"".join(frame(call) for call in calls))
        client = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(sock))))

        assert [client._recv("get_app_stats").app for _ in apps] == apps


def test_frame_arriving_in_pieces(start_server):
    server = start_server()
    call = frame(encode_call("ping", appstats.AppStats.ping_args()))
    with raw_connection(server) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index in range(len(call)):
            sock.sendall(call[index : index + 1])
            gevent.sleep(0.001)
        client = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(sock))))

        assert client._recv("ping") == "pong"


class _Socket:
    """The read side of a connected socket, as a thriftpy2 transport."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, size: int) -> bytes:
        return self._sock.recv(size)


@pytest.mark.parametrize("length", [4097, -1, 2**31 - 1])
def test_bad_frame_length_closes_only_that_connection(start_server, handler, length):
    server = start_server(max_frame_bytes=4096, max_string_bytes=1024)
    busy = thrift_client(server)
    in_flight = gevent.spawn(busy.get_app_stats, request("slow"))
    assert handler.entered.wait(timeout=5)

    bad = raw_connection(server)
    bad.sendall(struct.pack("!i", length) + b"x" * 16)
    assert read_until_closed(bad) == b""
    assert server.stats.frames_rejected == 1

    handler.released.set()
    assert in_flight.get(timeout=5) == sample_response("slow")
    assert busy.ping() == "pong"
    assert thrift_client(server).ping() == "pong"


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_struct_claiming_more_than_its_frame_is_rejected(
    start_server, handler, transport, protocol
):
    server = start_server(transport=transport, protocol=protocol)
    ping = encode_call("ping", appstats.AppStats.ping_args(), protocol)
    sock = raw_connection(server)
    if transport == "framed":
        # The next frame follows at once: a decoder that read past its frame would take
        # its bytes as the rest of the string and answer a call nobody made.
        sock.sendall(frame(truncated_call(protocol)) + frame(ping))
    else:
        sock.sendall(truncated_call(protocol))
        sock.shutdown(socket.SHUT_WR)

    assert read_until_closed(sock) == b""
    assert handler.requests == []
    if transport == "framed":
        assert server.stats.frames_rejected == 1
    assert thrift_client(server, transport, protocol).ping() == "pong"


@pytest.mark.parametrize(
    "protocol,bad_call",
    [
        ("binary", truncated_call("binary")),
        ("compact", truncated_call("compact")),
        ("binary", call_with_string_length(2**31 - 1)),
        ("binary", call_with_string_length(1_000_000)),
        ("binary", call_with_string_length(-5)),
    ],
)
def test_decoder_never_reads_past_the_frame(protocol, bad_call):
    server_side, peer = socket.socketpair()
    with server_side, peer:
        server_side.settimeout(5)
        channel = FramedChannel(server_side, 4096)
        ping = encode_call("ping", appstats.AppStats.ping_args(), protocol)
        peer.sendall(frame(bad_call) + frame(ping))
        processor = TProcessor(appstats.AppStats, RecordingHandler())

        assert channel.next_message()
        with pytest.raises(MessageRejected) as caught:  # the wire scan refuses it
            processor.process_in(protocol_for(protocol)(channel.input))
        assert not isinstance(caught.value, OSError)  # a decode failure, not a socket one
        # The following frame is intact, untouched by the failed decode.
        assert channel.next_message()
        assert processor.process_in(protocol_for(protocol)(channel.input))[0] == "ping"


@pytest.mark.parametrize("claimed", [2**31 - 1, 1_000_000, -5])
def test_string_length_beyond_the_frame_is_rejected(start_server, handler, claimed):
    server = start_server()
    sock = raw_connection(server)
    sock.sendall(frame(call_with_string_length(claimed)))

    assert read_until_closed(sock) == b""
    assert handler.requests == []
    assert server.stats.frames_rejected == 1
    assert thrift_client(server).ping() == "pong"


def test_buffered_message_is_bounded_by_max_frame_bytes(start_server, handler):
    server = start_server(transport="buffered", max_frame_bytes=1024, max_string_bytes=512)
    big = encode_call(
        "get_app_stats", appstats.AppStats.get_app_stats_args(request=request("A" * 8000))
    )
    sock = raw_connection(server)
    sock.sendall(big)

    assert read_until_closed(sock) == b""
    assert handler.requests == []
    assert server.stats.frames_rejected == 1


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_a_message_exactly_at_max_frame_bytes_is_served_and_one_byte_more_is_not(
    start_server, handler, transport
):
    def app_of(size: int) -> str:
        base = encode_call(
            "get_app_stats", appstats.AppStats.get_app_stats_args(request=request(""))
        )
        return "A" * (size - len(base))

    def call_of(size: int) -> bytes:
        return encode_call(
            "get_app_stats", appstats.AppStats.get_app_stats_args(request=request(app_of(size)))
        )

    limit = 2048
    server = start_server(transport=transport, max_frame_bytes=limit, max_string_bytes=limit)
    wire = frame if transport == "framed" else (lambda payload: payload)
    exact, over = call_of(limit), call_of(limit + 1)
    assert (len(exact), len(over)) == (limit, limit + 1)
    with raw_connection(server) as sock:
        sock.sendall(wire(exact))
        client = TClient(
            appstats.AppStats,
            TCyBinaryProtocol(
                (TCyFramedTransport if transport == "framed" else TCyBufferedTransport)(
                    _Socket(sock)
                )
            ),
        )
        assert client._recv("get_app_stats") == sample_response(app_of(limit))
    assert len(handler.requests) == 1 and server.stats.frames_rejected == 0
    with raw_connection(server) as sock:
        sock.sendall(wire(over))
        assert read_until_closed(sock) == b""
    assert len(handler.requests) == 1 and server.stats.frames_rejected == 1


def test_buffered_channel_rejects_past_its_budget():
    server_side, peer = socket.socketpair()
    with server_side, peer:
        server_side.settimeout(5)
        channel = BufferedChannel(server_side, 1024)
        peer.sendall(
            encode_call(
                "get_app_stats", appstats.AppStats.get_app_stats_args(request=request("A" * 8000))
            )
        )
        processor = TProcessor(appstats.AppStats, RecordingHandler())
        assert channel.next_message()
        with pytest.raises(FrameRejected):
            processor.process_in(TCyBinaryProtocol(channel.input))


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_garbage_closes_the_connection_and_is_counted(start_server, transport):
    server = start_server(transport=transport)
    garbage = b"\x00\x00\x00\x05hello, this is not thrift"
    sock = raw_connection(server)
    sock.sendall(frame(garbage) if transport == "framed" else garbage)

    assert read_until_closed(sock) == b""
    assert server.stats.frames_rejected == 1
    assert thrift_client(server, transport).ping() == "pong"


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_undeclared_exception_becomes_internal_error(start_server, caplog, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)
    client = thrift_client(server, transport, protocol)

    with caplog.at_level(logging.ERROR, logger="service.listener.server"):
        with pytest.raises(TApplicationException) as caught:
            client.get_app_stats(request("internal"))

    error = caught.value
    assert error.type == TApplicationException.INTERNAL_ERROR
    match = re.fullmatch(r"internal error \(request id ([0-9a-f]+)\)", error.message)
    assert match, error.message
    assert SECRET not in error.message and "Traceback" not in error.message
    logged = [record for record in caplog.records if match.group(1) in record.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert server.stats.internal_errors == 1
    # The same connection carries on.
    assert client.get_app_stats(request("shop")) == sample_response("shop")
    assert server.stats.connections_total == 1


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_reply_that_cannot_be_encoded_becomes_internal_error(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)
    client = thrift_client(server, transport, protocol)

    with pytest.raises(TApplicationException) as caught:
        client.get_app_stats(request("unencodable"))
    assert caught.value.type == TApplicationException.INTERNAL_ERROR
    assert server.stats.internal_errors == 1
    assert client.get_app_stats(request("shop")) == sample_response("shop")


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_declared_exception_arrives_typed(start_server, transport, protocol):
    server = start_server(transport=transport, protocol=protocol)
    client = thrift_client(server, transport, protocol)

    with pytest.raises(appstats.InvalidRequest) as caught:
        client.get_app_stats(request(""))
    assert caught.value.field == "app"
    assert client.ping() == "pong"
    assert server.stats.internal_errors == 0


def test_unknown_method_keeps_the_connection_usable(start_server):
    server = start_server()
    sock = TSocket(*server.address, socket_timeout=5000)
    transport = TCyFramedTransport(sock)
    proto = TCyBinaryProtocol(transport)
    transport.open()
    try:
        proto.write_message_begin("no_such_method", TMessageType.CALL, 1)
        appstats.AppStats.ping_args().write(proto)
        proto.write_message_end()
        transport.flush()
        _, message_type, _ = proto.read_message_begin()
        error = TApplicationException()
        error.read(proto)

        assert message_type == TMessageType.EXCEPTION
        assert error.type == TApplicationException.UNKNOWN_METHOD
        assert TClient(appstats.AppStats, proto).ping() == "pong"
    finally:
        transport.close()


def test_connections_past_the_limit_wait_until_one_closes(start_server):
    server = start_server(max_connections=2)
    first, second = thrift_client(server), thrift_client(server)
    assert first.ping() == second.ping() == "pong"

    third = thrift_client(server)  # the kernel queues it in the listen backlog
    waiting = gevent.spawn(third.ping)
    gevent.wait([waiting], timeout=0.5)
    assert not waiting.ready()
    assert server.stats.connections_open == 2

    first.close()
    assert waiting.get(timeout=5) == "pong"
    assert server.stats.connections_total == 3


def test_stop_lets_the_call_in_progress_finish(start_server, handler):
    server = start_server()
    busy, idle = thrift_client(server), thrift_client(server)
    assert idle.ping() == "pong"
    in_flight = gevent.spawn(busy.get_app_stats, request("slow"))
    assert handler.entered.wait(timeout=5)

    stopping = gevent.spawn(server.stop, 30.0)
    wait_for(lambda: server.stats.connections_open == 1)  # the idle one is closed at once
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(server.address, timeout=5)
    assert not stopping.ready()

    handler.released.set()
    assert in_flight.get(timeout=5) == sample_response("slow")
    stopping.get(timeout=5)
    assert server.stats.connections_open == 0


def test_stop_returns_promptly_with_idle_connections(start_server):
    server = start_server()
    clients = [thrift_client(server) for _ in range(3)]
    assert [client.ping() for client in clients] == ["pong"] * 3

    started = time.monotonic()
    server.stop(timeout_s=30.0)
    assert time.monotonic() - started < 5.0
    assert server.stats.connections_open == 0
    server.stop()  # idempotent


def test_a_call_that_arrived_as_the_drain_began_is_answered_not_dropped(start_server):
    """A pooled connection's next call, or a just-accepted connection's first, can reach the
    server as it starts to drain; the connection looked idle, but the call is answered."""
    server = start_server()
    ping = frame(encode_call("ping", appstats.AppStats.ping_args()))
    with raw_connection(server) as pooled, raw_connection(server) as fresh:
        client = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(pooled))))
        pooled.sendall(ping)
        assert client._recv("ping") == "pong"  # now idle, waiting for its next call
        gevent.sleep(0.05)  # and the fresh one accepted, waiting for its first
        # Sent, then the drain starts before any connection greenlet runs again.
        pooled.sendall(ping)
        fresh.sendall(ping)
        report = server.stop(timeout_s=5.0)
        assert client._recv("ping") == "pong"
        fresh_client = TClient(
            appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(fresh)))
        )
        assert fresh_client._recv("ping") == "pong"
        assert read_until_closed(pooled) == b"" and read_until_closed(fresh) == b""
    assert report.idle_closed == 0 and server.stats.connections_open == 0


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_idle_connection_times_out(start_server, transport):
    server = start_server(transport=transport, idle_timeout_ms=100)
    sock = raw_connection(server)

    assert read_until_closed(sock) == b""
    wait_for(lambda: server.stats.connections_open == 0)
    assert server.stats.frames_rejected == 0 and server.stats.internal_errors == 0


def test_address_before_start_raises():
    server = ThriftServer(TProcessor(appstats.AppStats, RecordingHandler()), ServerSettings(port=0))
    with pytest.raises(RuntimeError):
        server.address


def test_connections_older_than_max_connection_age_are_closed_between_calls(start_server):
    server = start_server(max_connection_age_ms=200)
    client = AppStatsClient(*server.address, pool_size=1)
    try:
        assert client.ping() == "pong"
        gevent.sleep(0.3)
        assert client.ping() == "pong"  # served, then the aged connection is closed
        wait_for(lambda: server.stats.connections_open == 0, what="the aged connection closed")
        assert client.ping() == "pong"  # on a new connection (the client retries)
        assert server.stats.connections_total == 2
    finally:
        client.close()


def test_message_waiting_polls_without_reading_and_a_closed_socket_has_none():
    from service.wire.channels import open_channel

    ours, peer = socket.socketpair()
    channel = open_channel("framed", ours, ServerSettings().wire_limits(), "binary")
    assert channel.message_waiting() is False
    peer.sendall(frame(encode_call("ping", appstats.AppStats.ping_args())))
    assert channel.message_waiting() is True
    assert channel.message_waiting() is True  # polled, not read
    ours.close()
    peer.close()
    assert channel.message_waiting() is False  # closed under it: no error, nothing waiting


# --- connections that move to another server (service.listener.handover) -----------------------------


def _into(server: ThriftServer, moved: list[bytes]):
    """A sink handing a connection to ``server`` as a worker's control line does: a copy of
    the descriptor, and the bytes read of it."""
    import os

    def sink(sock: socket.socket, unread: bytes) -> bool:
        moved.append(unread)
        return server.adopt(socket.socket(fileno=os.dup(sock.fileno())), unread)

    return sink


def test_an_idle_connection_moves_at_once_and_goes_on_answering(start_server):
    first, second = start_server(), start_server()
    moved: list[bytes] = []
    client = thrift_client(first)
    assert client.ping() == "pong"
    wait_for(lambda: first.connection_counts() == (1, 1), 5, "the connection open and idle")
    assert first.move_some(5, _into(second, moved)) == 1
    wait_for(lambda: first.stats.connections_moved == 1, 5, "the idle connection moved")
    assert client.ping() == "pong" and client.panels() == ["alerts", "errors", "latency", "urls"]
    assert moved == [b""] and second.stats.connections_adopted == 1
    assert first.connection_counts() == (0, 0) and second.connection_counts() == (1, 1)


def test_a_busy_connection_moves_after_its_reply_with_the_next_call_it_had_read(
    start_server, handler
):
    first, second = start_server(), start_server()
    moved: list[bytes] = []
    calls = [
        encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(request=request("slow"))),
        encode_call("ping", appstats.AppStats.ping_args()),
    ]
    with raw_connection(first) as sock:
        sock.sendall(b"".join(frame(call) for call in calls))  # read together, in one recv
        assert handler.entered.wait(5)
        assert first.move_some(1, _into(second, moved)) == 1
        assert first.stats.connections_moved == 0  # not while its call runs
        handler.released.set()
        client = TClient(appstats.AppStats, TCyBinaryProtocol(TCyFramedTransport(_Socket(sock))))
        assert client._recv("get_app_stats") == sample_response("slow")
        assert client._recv("ping") == "pong"  # answered by the second server
    assert moved == [frame(calls[1])]
    assert first.stats.connections_moved == 1 and second.stats.connections_adopted == 1


def test_stopping_with_a_destination_moves_every_connection_instead_of_closing_it(start_server):
    first, second = start_server(), start_server()
    moved: list[bytes] = []
    clients = [thrift_client(first) for _ in range(3)]
    assert [client.ping() for client in clients] == ["pong"] * 3
    report = first.stop(timeout_s=5.0, move_to=_into(second, moved))
    assert report.idle_closed == 0 and first.stats.connections_moved == 3
    assert [client.ping() for client in clients] == ["pong"] * 3
    assert second.connection_counts() == (3, 3)
