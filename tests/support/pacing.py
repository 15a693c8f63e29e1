"""Callers that ignore ``retry_after_ms``, and a server that is nearly always saturated.

For the pacing tests (``test_pacing.py``, ``test_held_connections.py``): plain Thrift
callers on raw sockets that call again at once after an ``Overloaded``, hand-encoded
calls with their own seqids, and a server admitting one call at a time.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import gevent
import pytest
from thriftpy2.protocol import TBinaryProtocol
from thriftpy2.protocol.cybin import TCyBinaryProtocol
from thriftpy2.thrift import TClient
from thriftpy2.transport import TMemoryBuffer, TSocket
from thriftpy2.transport.framed import TCyFramedTransport

from bench.load.frames import encode_call
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData
from service.samples.faults import FaultyHttpService

__all__ = [
    "CALLERS",
    "CALLER_TIMEOUT_S",
    "DEADLINE_MS",
    "slow_alerts",
    "one_call_at_a_time",
    "stats_request",
    "plain_client",
    "impatient_caller",
    "hammer",
    "call_frame",
    "reply",
    "recv_exactly",
]

CALLERS = 16
DEADLINE_MS = 1000
#: The callers' socket timeout: long enough that only a hang trips it. Whether a reply came
#: in time is not judged by the clock here: the callers share a process and 2 cores with the
#: server (and, in ``make test``, with four other test processes), and a reply 0.3 s past
#: its deadline was seen there. A hold's bound is asserted on the decision itself.
CALLER_TIMEOUT_S = DEADLINE_MS / 1000.0 + 10.0


@pytest.fixture
def slow_alerts(sample_data: SampleData) -> Iterator[FaultyHttpService]:
    service = FaultyHttpService(sample_data).start()
    service.set_mode("slow", delay_ms=300)
    yield service
    service.stop()


def one_call_at_a_time(
    start_service: Any, slow_alerts: FaultyHttpService, hold: bool, **overrides: Any
) -> Any:
    """A server admitting one call at a time, each taking at least 300 ms."""
    service, _ = start_service(
        **{
            "http.alerts_url": slow_alerts.url,
            "admission.initial_limit": 1,
            "admission.min_limit": 1,
            "admission.max_limit": 1,
            "admission.hold_refusals": str(hold).lower(),
            **overrides,
        }
    )
    return service


def stats_request(deadline_ms: int = DEADLINE_MS) -> Any:
    """A ``get_app_stats`` request for every panel of the sample day, with ``deadline_ms``."""
    return appstats.StatsRequest(
        app="shop",
        start_ms=SAMPLE_START_MS,
        end_ms=SAMPLE_END_MS,
        meta=appstats.RequestMeta(deadline_ms=deadline_ms),
    )


def plain_client(sock: socket.socket, transport: Any = TCyFramedTransport) -> Any:
    """A plain thriftpy2 binary client over a connected ``sock``."""
    return TClient(appstats.AppStats, TCyBinaryProtocol(transport(TSocket(sock=sock))))


def impatient_caller(
    address: tuple[str, int], seconds: float, transport: Any = TCyFramedTransport
) -> Counter[str]:
    """A plain Thrift client on one connection calling again at once after an Overloaded."""
    sock = socket.create_connection(address, timeout=CALLER_TIMEOUT_S)
    client = plain_client(sock, transport)
    request = stats_request()
    kinds: Counter[str] = Counter()
    ends = time.monotonic() + seconds
    try:
        while time.monotonic() < ends:
            try:
                client.get_app_stats(request)
                kinds["answered"] += 1
            except appstats.Overloaded:
                kinds["overloaded"] += 1
    finally:
        sock.close()
    return kinds


def hammer(address: tuple[str, int], seconds: float, **caller: Any) -> list[Counter[str]]:
    """:data:`CALLERS` impatient callers for ``seconds``; what each was answered."""
    callers = [gevent.spawn(impatient_caller, address, seconds, **caller) for _ in range(CALLERS)]
    gevent.joinall(callers, timeout=seconds + 10)
    assert all(c.ready() for c in callers), "a caller hung"
    return [c.get() for c in callers]  # re-raises a transport error


def call_frame(seqid: int) -> bytes:
    """A framed binary ``get_app_stats`` call with ``seqid``."""
    return encode_call(
        "get_app_stats", appstats.AppStats.get_app_stats_args(request=stats_request()), seqid
    )


def reply(sock: socket.socket) -> tuple[int, Any]:
    """The seqid and decoded result of one framed binary reply."""
    (length,) = struct.unpack("!i", recv_exactly(sock, 4))
    body = recv_exactly(sock, length)
    protocol = TBinaryProtocol(TMemoryBuffer(body))
    _, _, seqid = protocol.read_message_begin()
    result = appstats.AppStats.get_app_stats_result()
    result.read(protocol)
    return seqid, result


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        assert more, "connection closed"
        data += more
    return data
