"""The benchmark's floor of refusing (bench.baselines.refusing) answers as Fanout does.

It must answer ``ping`` (the harness pings every server before loading it), refuse
``get_app_stats`` with a declared ``Overloaded`` that a plain Thrift client reads, keep
each call's seqid, and hold a caller back too early as pacing does, within its deadline.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
from gevent.server import StreamServer
from thriftpy2.protocol.binary import TBinaryProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport.memory import TMemoryBuffer

from bench.baselines.refusing import serve_refusing
from service.idl import appstats
from tests.support.thrift_calls import encode_call, frame, thrift_client

DEADLINE_MS = 600


@pytest.fixture
def floor() -> Iterator[StreamServer]:
    server = StreamServer(("127.0.0.1", 0), serve_refusing(DEADLINE_MS))
    server.start()
    try:
        yield server
    finally:
        server.stop(timeout=1)


def test_the_floor_answers_ping_and_refuses_each_call_held_once_the_caller_is_early(floor) -> None:
    client = thrift_client(floor)
    request = appstats.StatsRequest(app="shop", start_ms=0, end_ms=1)
    try:
        assert client.ping() == "pong"
        held = []
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(appstats.Overloaded) as refused:
                client.get_app_stats(request)
            held.append(time.monotonic() - started)
            assert refused.value.retry_after_ms == 10_000
        assert client.ping() == "pong"
    finally:
        client.close()
    # The first refusal at once; the callers back at once are held, never past the deadline.
    assert held[0] < held[1] and held[0] < held[2]
    assert all(h < DEADLINE_MS / 1000 for h in held[1:])


def test_the_floor_answers_with_the_seqid_of_the_call(floor) -> None:
    args = appstats.AppStats.get_app_stats_args(
        request=appstats.StatsRequest(app="shop", start_ms=0, end_ms=1)
    )
    with socket.create_connection(floor.address, timeout=5) as sock:
        sock.sendall(frame(encode_call("get_app_stats", args)))  # seqid 7
        reply = b""
        while len(reply) < 4 or len(reply) < 4 + struct.unpack_from("!i", reply)[0]:
            reply += sock.recv(65536)
    protocol = TBinaryProtocol(TMemoryBuffer(reply[4:]))
    assert protocol.read_message_begin() == ("get_app_stats", TMessageType.REPLY, 7)
    result = appstats.AppStats.get_app_stats_result()
    result.read(protocol)
    assert result.overloaded is not None and result.success is None


def test_the_floor_closes_a_connection_whose_frame_claims_more_than_the_limit(floor) -> None:
    with socket.create_connection(floor.address, timeout=5) as sock:
        sock.sendall(struct.pack("!i", 2 * 1024 * 1024) + b"x" * 64)
        assert sock.recv(65536) == b""  # closed, nothing answered, nothing gathered
