"""Fuzzing the live server: random frames and mutated valid calls, on every transport x protocol.

Each example goes to a real in-process ``ThriftServer`` over a fresh socket,
sometimes followed by a valid ``ping`` on the same connection. The client then
half-closes, and the server must either answer with complete, well-formed
replies (results, declared exceptions or ``TApplicationException``) and then
close, or close without answering: never hang (a 5 s socket timeout fails the
example), never raise an internal error, never let an error reach the hub.
After the run the server still answers valid calls on a new connection, and
the process's memory grew by less than 64 MiB.

Mutations of valid calls: truncation, bit flips, integers written over random
bytes, lies in the frame length, in a string's length and in a list's count,
and deeply nested unknown fields (structs, lists and maps) in both protocols.

``FANOUT_FUZZ_EXAMPLES`` is the number of examples across all the tests here
(default 3000, derandomized for reproducible runs); ``make fuzz`` sets it to
50000 and draws fresh random examples.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.protocol.compact import TCompactProtocol
from thriftpy2.thrift import TApplicationException, TMessageType, TProcessor

from service.engine.settings import FanOutSettings
from service.idl import appstats
from service.listener.server import ThriftServer
from service.rpc.validation import validate_stats_request
from service.settings.server import ServerSettings
from tests.support.server import COMBINATIONS, read_until_closed, sample_response
from tests.support.thrift_calls import encode_call, thrift_client
from tests.test_wire_limits import (
    on_the_wire,
    varint,
    with_list_count,
    with_string_length,
    with_unknown_field,
)

_FUZZ_TESTS = 2 * len(COMBINATIONS)
TOTAL_EXAMPLES = int(os.environ.get("FANOUT_FUZZ_EXAMPLES", "3000"))
LONG_RUN = "FANOUT_FUZZ_EXAMPLES" in os.environ
FUZZ = settings(
    max_examples=max(TOTAL_EXAMPLES // _FUZZ_TESTS, 1),
    deadline=None,
    derandomize=not LONG_RUN,
    database=None,
    print_blob=True,
)
MEMORY_GROWTH_LIMIT = 64 * 1024 * 1024
PANELS = ["errors", "urls", "controllers", "queries", "alerts", "latency", "volume"]
INTERESTING = [
    -1,
    -(2**31),
    0,
    1,
    127,
    128,
    255,
    256,
    10_000,
    10_001,
    65_535,
    65_536,
    65_537,
    2**20,
    2**20 + 1,
    2**31 - 1,
]


class FuzzHandler:
    """The real request validation in front of a canned answer; records nothing."""

    def ping(self) -> str:
        return "pong"

    def panels(self) -> list[str]:
        return PANELS

    def health(self) -> Any:
        return appstats.Health(state=appstats.ServingState.SERVING, backends=[])

    def get_app_stats(self, request: Any) -> Any:
        valid = validate_stats_request(request, PANELS, PANELS, FanOutSettings())
        return sample_response(valid.window.app)


@pytest.fixture
def fuzz_server() -> Iterator[Callable[[str, str], ThriftServer]]:
    servers: list[ThriftServer] = []

    def start(transport: str, protocol: str) -> ThriftServer:
        server = ThriftServer(
            TProcessor(appstats.AppStats, FuzzHandler()),
            ServerSettings(
                host="127.0.0.1",
                port=0,
                transport=transport,
                protocol=protocol,
                frame_timeout_ms=2_000,
                max_connections=64,
            ),
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=5.0)


@pytest.fixture
def hub_errors() -> Iterator[list[Any]]:
    """Errors that reach the gevent hub (an uncaught exception in any greenlet) during the test."""
    hub = gevent.get_hub()
    errors: list[Any] = []
    original = hub.handle_error
    overridden = "handle_error" in vars(hub)

    def record(context: Any, kind: Any, value: Any, tb: Any) -> None:
        if isinstance(kind, type) and not issubclass(kind, hub.NOT_ERROR):
            errors.append((context, kind, value))
        original(context, kind, value, tb)

    hub.handle_error = record  # gevent's documented per-instance override
    yield errors
    if overridden:
        hub.handle_error = original
    else:
        del hub.handle_error


# --- Strategies ----------------------------------------------------------------------------

_requests = st.builds(
    appstats.StatsRequest,
    app=st.one_of(st.sampled_from(["shop", "", "a" * 65]), st.text(max_size=40)),
    start_ms=st.one_of(st.just(1_000), st.integers(-(2**63), 2**63 - 1)),
    end_ms=st.one_of(st.just(90_000), st.integers(-(2**63), 2**63 - 1)),
    panels=st.none() | st.lists(st.sampled_from(PANELS) | st.text(max_size=12), max_size=9),
    meta=st.none()
    | st.builds(
        appstats.RequestMeta,
        headers=st.none() | st.dictionaries(st.text(max_size=12), st.text(max_size=40), max_size=4),
        deadline_ms=st.none() | st.integers(-(2**31), 2**31 - 1),
        request_id=st.none() | st.text(max_size=70),
    ),
)

_calls = st.one_of(
    st.sampled_from(
        [
            ("ping", appstats.AppStats.ping_args()),
            ("panels", appstats.AppStats.panels_args()),
            ("health", appstats.AppStats.health_args()),
            ("no_such_method", appstats.AppStats.ping_args()),
        ]
    ),
    _requests.map(lambda r: ("get_app_stats", appstats.AppStats.get_app_stats_args(request=r))),
)


@st.composite
def random_frames(draw: Any, transport: str) -> bytes:
    """Random bytes, often behind the first bytes of a binary or compact call."""
    payload = draw(st.sampled_from([b"", b"\x80\x01\x00\x01", b"\x82\x21"])) + draw(
        st.binary(max_size=300)
    )
    if transport == "buffered":
        return payload
    length = draw(
        st.one_of(
            st.just(len(payload)), st.sampled_from(INTERESTING), st.integers(-(2**31), 2**31 - 1)
        )
    )
    return struct.pack("!i", length) + payload


@st.composite
def mutated_calls(draw: Any, transport: str, protocol: str) -> bytes:
    """A valid call, mutated once (or not at all), framed as the transport wants, sometimes
    with a valid ping after it on the same connection."""
    method, args = draw(_calls)
    message = encode_call(method, args, protocol)
    mutation = draw(
        st.sampled_from(
            ["none", "truncate", "flip", "overwrite", "string", "count", "nest", "frame"]
        )
    )
    message = _MUTATIONS[mutation](draw, message, args, protocol)
    payload = on_the_wire(message, transport)
    if mutation == "frame" and transport == "framed":
        payload = struct.pack("!i", draw(st.sampled_from(INTERESTING))) + payload[4:]
    if draw(st.booleans()):
        payload += on_the_wire(
            encode_call("ping", appstats.AppStats.ping_args(), protocol), transport
        )
    return payload


def _truncate(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    return message[: draw(st.integers(0, len(message) - 1))]


def _flip(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    flipped = bytearray(message)
    for _ in range(draw(st.integers(1, 8))):
        flipped[draw(st.integers(0, len(flipped) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(flipped)


def _overwrite(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    """An interesting integer written at a random place, as a length or count would be."""
    at = draw(st.integers(0, len(message) - 1))
    value = draw(st.sampled_from(INTERESTING) | st.integers(-(2**31), 2**31 - 1))
    if protocol == "binary":
        return message[:at] + struct.pack("!i", value) + message[at + 4 :]
    return message[:at] + varint(value & 0xFFFFFFFF) + message[at + 1 :]


def _string_lie(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    request = getattr(args, "request", None)
    if request is None or not request.app:
        return _overwrite(draw, message, args, protocol)
    claimed = draw(st.sampled_from([value for value in INTERESTING if value >= 0]))
    return with_string_length(message, protocol, request.app, claimed)


def _count_lie(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    request = getattr(args, "request", None)
    if request is None or not request.panels or not request.panels[0]:
        return _overwrite(draw, message, args, protocol)
    claimed = draw(st.sampled_from([value for value in INTERESTING if value >= 0]))
    return with_list_count(message, protocol, request.panels[0], claimed)


def _nest(draw: Any, message: bytes, args: Any, protocol: str) -> bytes:
    """A deeply nested unknown field: structs, lists of lists or maps of maps."""
    depth = draw(st.integers(1, 200))
    shape = draw(st.sampled_from(["struct", "list", "map"]))
    return with_unknown_field(message, _nested(protocol, shape, depth))


def _nested(protocol: str, shape: str, depth: int) -> bytes:
    """An unknown field (id 100) holding ``depth`` levels of ``shape``."""
    if protocol == "binary":
        field = {"struct": b"\x0c", "list": b"\x0f", "map": b"\x0d"}[shape] + b"\x00\x64"
        level = {
            "struct": b"\x0c\x00\x64",
            "list": b"\x0f\x00\x00\x00\x01",
            "map": b"\x08\x0d\x00\x00\x00\x01" + b"\x00\x00\x00\x07",
        }[shape]
        innermost = {
            "struct": b"\x00",
            "list": b"\x08\x00\x00\x00\x00",
            "map": b"\x08\x08\x00\x00\x00\x00",
        }[shape]
        closing = b"\x00" if shape == "struct" else b""
        return field + level * (depth - 1) + innermost + closing * (depth - 1)
    field = {"struct": b"\x0c", "list": b"\x09", "map": b"\x0b"}[shape] + varint(200)
    level = {"struct": b"\x0c" + varint(200), "list": b"\x19", "map": b"\x01\x5b" + b"\x0e"}[shape]
    innermost = {"struct": b"\x00", "list": b"\x05", "map": b"\x00"}[shape]
    closing = b"\x00" if shape == "struct" else b""
    return field + level * (depth - 1) + innermost + closing * (depth - 1)


_MUTATIONS = {
    "none": lambda draw, message, args, protocol: message,
    "truncate": _truncate,
    "flip": _flip,
    "overwrite": _overwrite,
    "string": _string_lie,
    "count": _count_lie,
    "nest": _nest,
    "frame": lambda draw, message, args, protocol: message,
}


# --- One exchange, and what may come back ----------------------------------------------------


def exchange(server: ThriftServer, payload: bytes) -> bytes:
    """Send ``payload`` on a fresh connection, half-close, and read until the server closes."""
    with socket.create_connection(server.address, timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed first: it refused what it had read
        return read_until_closed(sock)  # TimeoutError: the server hung


def check_replies(received: bytes, transport: str, protocol: str) -> None:
    """``received`` is a sequence of complete replies and nothing else."""
    position = 0
    while position < len(received):
        if transport == "framed":
            (length,) = struct.unpack_from("!i", received, position)
            body = received[position + 4 : position + 4 + length]
            assert len(body) == length, "a reply frame was cut short"
            assert _decode_reply(body, protocol) == length
            position += 4 + length
        else:
            position += _decode_reply(received[position:], protocol)


class _ExactReader:
    """Reply bytes for a pure-Python protocol; a read past their end fails the example."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0

    def read(self, size: int) -> bytes:
        chunk = self.data[self.position : self.position + size]
        assert len(chunk) == size, "a reply was cut short"
        self.position += size
        return chunk


def _decode_reply(data: bytes, protocol: str) -> int:
    """Decode one reply at the start of ``data``; the number of bytes it took."""
    buffer = _ExactReader(data)
    name, message_type = _reply_header(buffer, protocol)
    proto = TBinaryProtocol(buffer) if protocol == "binary" else TCompactProtocol(buffer)
    if message_type == TMessageType.EXCEPTION:
        TApplicationException().read(proto)
    else:
        assert message_type == TMessageType.REPLY
        getattr(appstats.AppStats, f"{name.decode()}_result")().read(proto)
    return buffer.position


def _reply_header(buffer: _ExactReader, protocol: str) -> tuple[bytes, int]:
    """(method name, message type), read by hand: the protocols' own readers insist on a
    UTF-8 name, and an unknown method's name comes back as the caller sent it."""
    if protocol == "binary":
        version, size = struct.unpack("!II", buffer.read(8))
        assert version & 0xFFFF0000 == 0x80010000
        name = buffer.read(size)
        buffer.read(4)  # seqid
        return name, version & 0xFF
    assert buffer.read(1) == b"\x82"
    message_type = buffer.read(1)[0] >> 5
    _read_varint(buffer)  # seqid
    return buffer.read(_read_varint(buffer)), message_type


def _read_varint(buffer: _ExactReader) -> int:
    result = shift = 0
    while True:
        byte = buffer.read(1)[0]
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result
        shift += 7


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fuzz(
    server: ThriftServer, strategy: Any, transport: str, protocol: str, hub_errors: list[Any]
) -> None:
    """Run the examples, then check the server is whole."""
    assert thrift_client(server, transport, protocol).ping() == "pong"  # warm
    before = resident_bytes()

    @FUZZ
    @given(payload=strategy)
    def one_example(payload: bytes) -> None:
        check_replies(exchange(server, payload), transport, protocol)

    one_example()
    client = thrift_client(server, transport, protocol)
    assert client.ping() == "pong"
    assert (
        client.get_app_stats(appstats.StatsRequest(app="shop", start_ms=1, end_ms=2)).app == "shop"
    )
    assert server.stats.internal_errors == 0
    assert hub_errors == []
    assert resident_bytes() - before < MEMORY_GROWTH_LIMIT


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_random_frames(fuzz_server, hub_errors, transport, protocol):
    server = fuzz_server(transport, protocol)
    fuzz(server, random_frames(transport), transport, protocol, hub_errors)
    assert server.stats.frames_rejected > 0


@pytest.mark.parametrize("transport,protocol", COMBINATIONS)
def test_mutated_calls(fuzz_server, hub_errors, transport, protocol):
    server = fuzz_server(transport, protocol)
    fuzz(server, mutated_calls(transport, protocol), transport, protocol, hub_errors)
    assert server.stats.frames_rejected > 0
