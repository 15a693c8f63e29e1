"""Bad input on the wire: every size limit, lying lengths, deep nesting, slow peers.

Each limit has a regression test against the live server: the offending
connection is closed, the right counter goes up, and a second connection, busy
in a call at the same time, is unaffected. The scanner's own tests follow.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import gevent
import pytest
from thriftpy2.thrift import TProcessor
from thriftpy2.transport import TTransportException

from service.idl import appstats
from service.listener.server import ThriftServer
from service.wire.channels import BufferedChannel
from service.wire.codec import HubCodec, decoder_for
from service.wire.errors import LimitExceeded, MalformedMessage
from service.wire.scan import MessageScan, WireLimits, check_frame
from tests.support.server import COMBINATIONS, RecordingHandler, read_until_closed, sample_response
from tests.support.sockets import raw_connection, wait_for
from tests.support.thrift_calls import encode_call, thrift_client

PROTOCOLS = ["binary", "compact"]


def request(app: str, panels: tuple[str, ...] = ("errors", "urls")) -> Any:
    return appstats.StatsRequest(app=app, start_ms=1_000, end_ms=2_000, panels=list(panels))


def stats_call(
    protocol: str, app: str = "shop", panels: tuple[str, ...] = ("errors", "urls")
) -> bytes:
    return encode_call(
        "get_app_stats",
        appstats.AppStats.get_app_stats_args(request=request(app, panels)),
        protocol,
    )


def ping_call(protocol: str) -> bytes:
    return encode_call("ping", appstats.AppStats.ping_args(), protocol)


def on_the_wire(message: bytes, transport: str) -> bytes:
    return struct.pack("!i", len(message)) + message if transport == "framed" else message


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def with_unknown_field(message: bytes, field: bytes) -> bytes:
    """``message`` with ``field`` last in its argument struct (before its STOP, the last byte;
    last, so that compact field-id deltas after it stay right)."""
    return message[:-1] + field + message[-1:]


def with_nested_unknown_field(message: bytes, protocol: str, depth: int) -> bytes:
    """``message`` with an unknown field (id 100) of ``depth`` structs, one in another:
    ``depth + 1`` levels with the argument struct."""
    opening = b"\x0c\x00\x64" if protocol == "binary" else b"\x0c" + varint(200)  # zigzag(100)
    return with_unknown_field(message, opening * depth + b"\x00" * depth)


def with_string_length(message: bytes, protocol: str, text: str, claimed: int) -> bytes:
    """``message`` with the length prefix of the string ``text`` replaced by ``claimed``."""
    start = message.index(text.encode())
    if protocol == "binary":
        return message[: start - 4] + struct.pack("!i", claimed) + message[start:]
    return message[: start - len(varint(len(text)))] + varint(claimed) + message[start:]


def with_list_count(message: bytes, protocol: str, first: str, claimed: int) -> bytes:
    """``message`` with the count of the list<string> whose first item is ``first`` replaced."""
    start = message.index(first.encode())
    if protocol == "binary":  # [element type][i32 count][i32 length][first]
        return message[: start - 8] + struct.pack("!i", claimed) + message[start - 4 :]
    at = start - len(varint(len(first))) - 1  # [count << 4 | type][varint length][first]
    return message[:at] + bytes([0xF0 | message[at] & 0x0F]) + varint(claimed) + message[at + 1 :]


@contextmanager
def call_in_flight(
    server: ThriftServer,
    handler: RecordingHandler,
    transport: str = "framed",
    protocol: str = "binary",
) -> Iterator[None]:
    """A second connection, busy in a call while the test misbehaves on its own; it must
    get its answer and go on working."""
    client = thrift_client(server, transport, protocol)
    call = gevent.spawn(client.get_app_stats, request("slow"))
    assert handler.entered.wait(timeout=5)
    yield
    assert thrift_client(server, transport, protocol).ping() == "pong"  # still accepting
    handler.released.set()
    assert call.get(timeout=5) == sample_response("slow")
    assert client.ping() == "pong"
    client.close()


def send_and_expect_closed(server: ThriftServer, payload: bytes) -> None:
    with raw_connection(server) as sock:
        sock.sendall(payload)
        assert read_until_closed(sock) == b""  # no reply: closed


def only_slow_call_reached(handler: RecordingHandler) -> bool:
    return [r.app for r in handler.requests] == ["slow"]


# --- Each limit against the live server ------------------------------------------------------


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_string_over_max_string_bytes(start_server, handler, transport, protocol):
    server = start_server(transport=transport, protocol=protocol, max_string_bytes=1024)
    with call_in_flight(server, handler, transport, protocol):
        send_and_expect_closed(server, on_the_wire(stats_call(protocol, app="a" * 2000), transport))
        wait_for(lambda: server.stats.limits_exceeded == 1)
    assert server.stats.frames_rejected == 1 and only_slow_call_reached(handler)


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_container_over_max_container_items(start_server, handler, transport, protocol):
    server = start_server(transport=transport, protocol=protocol, max_container_items=3)
    call = stats_call(protocol, panels=("errors", "urls", "alerts", "latency"))
    with call_in_flight(server, handler, transport, protocol):
        send_and_expect_closed(server, on_the_wire(call, transport))
        wait_for(lambda: server.stats.limits_exceeded == 1)
    assert server.stats.frames_rejected == 1 and only_slow_call_reached(handler)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_container_count_claiming_more_than_its_frame(start_server, handler, protocol):
    server = start_server(protocol=protocol)
    lie = with_list_count(stats_call(protocol, panels=("errors",)), protocol, "errors", 5_000)
    with call_in_flight(server, handler, protocol=protocol):
        send_and_expect_closed(server, on_the_wire(lie, "framed"))
        wait_for(lambda: server.stats.malformed_messages == 1)
    assert server.stats.frames_rejected == 1 and only_slow_call_reached(handler)


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_nesting_deeper_than_max_nesting_depth(start_server, handler, transport, protocol):
    server = start_server(transport=transport, protocol=protocol, max_nesting_depth=8)
    client = thrift_client(server, transport, protocol)
    # 7 unknown structs in the argument struct: 8 levels, answered (the field is skipped).
    allowed = with_nested_unknown_field(stats_call(protocol, app="nested"), protocol, 7)
    with raw_connection(server) as sock:
        sock.sendall(on_the_wire(allowed, transport))
        assert sock.recv(65536)
    assert [r.app for r in handler.requests] == ["nested"]
    handler.requests.clear()

    too_deep = with_nested_unknown_field(stats_call(protocol), protocol, 8)
    with call_in_flight(server, handler, transport, protocol):
        send_and_expect_closed(server, on_the_wire(too_deep, transport))
        wait_for(lambda: server.stats.limits_exceeded == 1)
    assert server.stats.frames_rejected == 1 and only_slow_call_reached(handler)
    assert client.ping() == "pong"


@pytest.mark.parametrize(
    "transport,protocol,claimed,counter",
    [
        ("framed", "binary", 1_000, "malformed_messages"),
        ("framed", "compact", 1_000, "malformed_messages"),
        ("framed", "binary", 2**31 - 1, "limits_exceeded"),
        ("buffered", "binary", 2**31 - 1, "limits_exceeded"),
        ("buffered", "compact", 2**31 - 1, "limits_exceeded"),
        ("buffered", "compact", 2**35, "malformed_messages"),  # a 6-byte varint: not a length
    ],
)
def test_string_claiming_more_than_its_frame(
    start_server, handler, transport, protocol, claimed, counter
):
    server = start_server(transport=transport, protocol=protocol)
    lie = with_string_length(stats_call(protocol, app="shop"), protocol, "shop", claimed)
    with call_in_flight(server, handler, transport, protocol):
        send_and_expect_closed(server, on_the_wire(lie, transport))
        wait_for(lambda: getattr(server.stats, counter) == 1)
    assert server.stats.frames_rejected == 1 and only_slow_call_reached(handler)


@pytest.mark.parametrize(
    "protocol,field",
    [
        # An unknown field: a map of 2**31 - 1 VOID -> VOID pairs, which take no bytes at all.
        ("binary", b"\x0d\x00\x64" + b"\x01\x01" + struct.pack("!i", 2**31 - 1)),
        # An unknown field: a list of 2**32 - 1 STOP "elements" (the pure-Python decoder loops on them).
        ("compact", b"\x09\xc8\x01" + b"\xf0" + varint(2**32 - 1)),
    ],
)
def test_elements_that_take_no_bytes_are_refused_at_once(start_server, handler, protocol, field):
    server = start_server(protocol=protocol)
    with call_in_flight(server, handler, protocol=protocol):
        send_and_expect_closed(
            server, on_the_wire(with_unknown_field(ping_call(protocol), field), "framed")
        )
        wait_for(lambda: server.stats.malformed_messages == 1)
    assert server.stats.frames_rejected == 1


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_slow_drip_is_closed_at_frame_timeout(start_server, handler, transport):
    server = start_server(transport=transport, frame_timeout_ms=300, idle_timeout_ms=60_000)
    payload = on_the_wire(ping_call("binary"), transport)
    with call_in_flight(server, handler, transport):
        with raw_connection(server) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for index in range(len(payload)):  # ~1 s in all, > 300 ms
                try:
                    sock.sendall(payload[index : index + 1])
                except OSError:
                    break  # closed under us: fine
                assert thrift_client(server, transport).ping() == "pong"  # others are served
                gevent.sleep(0.05)
            assert read_until_closed(sock) == b""  # closed, never answered
        wait_for(lambda: server.stats.slow_messages == 1)
    assert server.stats.frames_rejected == 1


def test_reply_never_read_is_dropped_at_frame_timeout(start_server, handler):
    server = start_server(frame_timeout_ms=300)
    big = on_the_wire(stats_call("binary", app="r" * 60_000), "framed")  # each reply ~60 kB
    with call_in_flight(server, handler):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(server.address)
        sock.settimeout(0.5)
        try:
            for _ in range(2_000):  # until the server stops reading; it never gets a reply taken
                sock.sendall(big)
        except OSError:
            pass
        wait_for(lambda: server.stats.slow_readers == 1, timeout_s=10)
        sock.close()
    assert server.stats.frames_rejected == 0


def _summaries(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "closed for what they sent" in r.getMessage()
    ]


def test_rejections_are_logged_at_warning(start_server, caplog):
    server = start_server(max_string_bytes=100)
    with caplog.at_level(logging.WARNING):
        send_and_expect_closed(server, on_the_wire(stats_call("binary", app="a" * 200), "framed"))
        wait_for(lambda: server.stats.limits_exceeded == 1)
        server.stop()  # the pending summary is written at shutdown (its timer: test_fanout.py)
    (line,) = _summaries(caplog)
    assert "limit exceeded x1" in line and "server.max_string_bytes" in line, line


def test_http_sent_to_the_thrift_port_is_summarised_once_not_per_connection(start_server, caplog):
    server = start_server()
    with caplog.at_level(logging.WARNING):
        for _ in range(40):
            send_and_expect_closed(server, b"GET /metrics HTTP/1.1\r\nHost: fanout\r\n\r\n")
        wait_for(lambda: server.stats.limits_exceeded == 40)
        server.stop()  # what is pending is written at shutdown: one line for the 40
    (line,) = _summaries(caplog)
    assert "HTTP sent to the Thrift port x40" in line and "looked like HTTP" in line, line


# --- The scanner and the decoder's input, directly -------------------------------------------


def _valid_messages(protocol: str) -> list[bytes]:
    meta = appstats.RequestMeta(
        headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        deadline_ms=500,
        request_id="r-1",
    )
    full = appstats.StatsRequest(
        app="shop", start_ms=0, end_ms=1, panels=["errors", "urls"], meta=meta
    )
    return [
        ping_call(protocol),
        encode_call("panels", appstats.AppStats.panels_args(), protocol),
        encode_call("health", appstats.AppStats.health_args(), protocol),
        encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(request=full), protocol),
        encode_call("no_such_method", appstats.AppStats.get_app_stats_args(request=full), protocol),
        with_nested_unknown_field(stats_call(protocol), protocol, 30),
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_valid_messages_pass_and_every_truncation_or_extension_fails(protocol):
    limits = WireLimits()
    for message in _valid_messages(protocol):
        check_frame(message, limits)
        check_frame(memoryview(bytearray(message)), limits)
        for cut in range(len(message)):
            with pytest.raises(MalformedMessage):
                check_frame(message[:cut], limits)
        with pytest.raises(MalformedMessage):
            check_frame(message + b"\x00", limits)


def old_style(message: bytes) -> bytes:
    """A strict binary message rewritten old-style: name length, name, type byte, seqid."""
    assert message[:2] == b"\x80\x01"
    name_end = 8 + struct.unpack("!i", message[4:8])[0]
    return message[4:name_end] + message[3:4] + message[name_end:]


def test_old_style_binary_is_scanned_exactly_like_strict_and_refused_when_strict():
    for strict in _valid_messages("binary"):
        message = old_style(strict)
        check_frame(message, WireLimits())
        for cut in range(len(message)):
            with pytest.raises(MalformedMessage):
                check_frame(message[:cut], WireLimits())
        with pytest.raises(MalformedMessage):
            check_frame(message + b"\x00", WireLimits())
        stream = message + ping_call("binary")
        scan = MessageScan(WireLimits(), framed=False)
        ends = [scan.advance(stream, available, 1 << 20) for available in range(len(stream) + 1)]
        assert ends.index(len(message)) == len(message)
        with pytest.raises(MalformedMessage, match="server.strict_binary = true"):
            check_frame(message, WireLimits(strict_binary=True))
    deep = old_style(with_nested_unknown_field(ping_call("binary"), "binary", 32))
    with pytest.raises(LimitExceeded):
        check_frame(deep, WireLimits(max_nesting_depth=32))
    long_name = b"\x00\x01\x00\x01" + b"x" * 65537 + b"\x01" + b"\x00" * 5
    with pytest.raises(LimitExceeded, match="max_string_bytes"):
        check_frame(long_name, WireLimits())
    with pytest.raises(MalformedMessage, match="message type"):
        check_frame(b"\x00\x00\x00\x04ping\x02\x00\x00\x00\x01\x00", WireLimits())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nesting_limit_counts_the_argument_struct(protocol):
    limits = WireLimits(max_nesting_depth=32)
    check_frame(with_nested_unknown_field(ping_call(protocol), protocol, 31), limits)
    with pytest.raises(LimitExceeded):
        check_frame(with_nested_unknown_field(ping_call(protocol), protocol, 32), limits)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_scan_resumes_byte_by_byte_and_finds_the_end(protocol):
    for message in _valid_messages(protocol):
        stream = message + ping_call(protocol)  # the next message follows at once
        scan = MessageScan(WireLimits(), framed=False)
        ends = [scan.advance(stream, available, 1 << 20) for available in range(len(stream) + 1)]
        assert ends.index(len(message)) == len(message)  # complete exactly when it is all here
        assert all(end is None for end in ends[: len(message)])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_buffered_channel_splits_pipelined_messages_arriving_in_pieces(protocol):
    messages = _valid_messages(protocol)
    stream = b"".join(messages)
    processor = TProcessor(appstats.AppStats, RecordingHandler())
    server_side, peer = socket.socketpair()
    with server_side, peer:
        channel = BufferedChannel(server_side, WireLimits(), protocol)
        sender = gevent.spawn(_send_in_pieces, peer, stream, 7)
        names = []
        for _ in messages:
            assert channel.next_message()
            names.append(processor.process_in(channel.read_message())[0])
        sender.get(timeout=5)
    assert names == ["ping", "panels", "health", "get_app_stats", "no_such_method", "get_app_stats"]


def _send_in_pieces(sock: socket.socket, data: bytes, size: int) -> None:
    for start in range(0, len(data), size):
        sock.sendall(data[start : start + size])
        gevent.sleep(0.001)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_decoder_input_ends_hard_even_without_the_scan(protocol):
    """Belt and braces: fed a message cut inside a string, bypassing the scan, the decoder
    raises end-of-file instead of returning bytes from outside the message."""
    cut = stats_call(protocol, app="A" * 300)
    cut = cut[: cut.index(b"A" * 300) + 10]
    processor = TProcessor(appstats.AppStats, RecordingHandler())
    decode = decoder_for(protocol, HubCodec())
    with pytest.raises(TTransportException) as caught:
        processor.process_in(decode(cut))
    assert caught.value.type == TTransportException.END_OF_FILE


@pytest.mark.parametrize(
    "head, looks_like",
    [(b"POST", "HTTP"), (b"PRI ", "HTTP"), (b"\x16\x03\x01\x02", "TLS"), (b"\x7f\x00\x00\x00", "")],
)
def test_a_rejected_frame_length_says_what_its_bytes_looked_like(head, looks_like):
    from service.wire.errors import FrameRejected

    rejected = FrameRejected(int.from_bytes(head, "big", signed=True), 16 * 1024 * 1024)
    assert rejected.looks_like == looks_like
    assert ("looked like" in str(rejected)) == bool(looks_like)
