"""Held connections: paced refusals served from the event loop, and handed back intact."""

from __future__ import annotations

import fcntl
import re
import socket
import struct
import termios
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import gevent
import pytest
import requests
from gevent.socket import wait_read
from thriftpy2.transport import TCyBufferedTransport

from service.idl import appstats
from service.overload.held_connections import HOLD_TICK_S, HeldConnections, HeldReply, on_the_tick
from service.samples.faults import FaultyHttpService
from service.testing import FakeClock
from tests.support.pacing import (
    CALLER_TIMEOUT_S,
    CALLERS,
    call_frame,
    hammer,
    one_call_at_a_time,
    plain_client,
    reply,
    stats_request,
)
from tests.support.sockets import wait_for
from tracing.spans import CallDurations

pytestmark = pytest.mark.solo  # make test runs it alone: tests/parallel.py


@pytest.fixture
def saturated(start_service: Any, slow_alerts: FaultyHttpService) -> Iterator[Callable[..., Any]]:
    """``saturated(**overrides)``: a server admitting one call at a time, its one slot taken
    by a call that hangs on the alerts service until the test ends; others are refused at
    once (no queueing). Its clock stands still (service/testing.py): a caller that
    comes back after a refusal is early however long the busy machine took to send it,
    so it is held; the holds themselves keep the loop's real time."""
    busy: list[Any] = []
    clock = FakeClock()

    def start(**overrides: Any) -> Any:
        slow_alerts.set_mode("hang")
        service = one_call_at_a_time(
            start_service,
            slow_alerts,
            hold=True,
            clock=clock,
            **{
                "fanout.request_deadline_ms": 10_000,
                "fanout.task_timeout_ms": 10_000,
                "http.read_timeout_ms": 10_000,
                "admission.queue_interval_ms": 0,
                "admission.queue_target_ms": 0,
                **overrides,
            },
        )
        busy.append(gevent.spawn(_long_call, service.address))
        wait_for(lambda: service.gate.admission.inflight >= 1, 5, "the slot taken")
        return service

    yield start
    slow_alerts.set_mode("slow", delay_ms=0)  # ends the hung call
    # The hang ends with its connection closed, unanswered: the call's retry backs off on the
    # standing clock, which must move for it to end before the server stops.
    patience = time.monotonic() + 5
    while not all(call.dead for call in busy) and time.monotonic() < patience:
        clock.advance(0.1)
        gevent.sleep(0.01)


def _long_call(address: tuple[str, int]) -> None:
    client = plain_client(socket.create_connection(address, timeout=15))
    try:
        client.get_app_stats(stats_request(deadline_ms=10_000))
    except Exception:  # cut by a drain: what matters is the slot it held meanwhile
        pass


def _held(service: Any, sock: socket.socket, seqid: int) -> int:
    """Refused after a read (seqid), then at once called again (seqid + 1), which is held
    while the slot stays taken; returns once it is, with the first refusal's retry_after_ms."""
    held = service.server.stats.replies_held
    sock.sendall(call_frame(seqid))
    got, result = reply(sock)
    assert got == seqid and result.overloaded is not None, result
    sock.sendall(call_frame(seqid + 1))
    wait_for(lambda: service.server.stats.replies_held > held, 5, "the call held")
    return result.overloaded.retry_after_ms


def test_callers_ignoring_retry_after_are_refused_from_the_loop_and_every_answer_is_theirs(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    service = one_call_at_a_time(start_service, slow_alerts, hold=True)
    kinds = hammer(service.address, 2.0)
    refused = sum(k["overloaded"] for k in kinds)
    stats = service.server.stats
    # Refused again while held, without their greenlets: the callers kept coming back early.
    assert stats.refused_while_held >= 1 and stats.replies_held >= stats.refused_while_held
    assert service.gate.stats.overloaded == refused
    # Every held connection went back to its greenlet, which closed it with its caller.
    wait_for(lambda: service.server.stats.connections_open == 0, 5, "connections closed")
    assert len(service.server._loop.held) == 0


def test_a_call_arriving_in_pieces_while_held_is_served_by_its_greenlet(
    saturated: Callable[..., Any],
) -> None:
    service = saturated()
    with socket.create_connection(service.address, timeout=CALLER_TIMEOUT_S) as sock:
        _held(service, sock, 11)
        assert reply(sock)[0] == 12
        frame = call_frame(13)
        sock.sendall(frame[:7])  # the held connection reads a piece: back to its greenlet
        gevent.sleep(0.05)
        sock.sendall(frame[7:])
        seqid, result = reply(sock)
        assert seqid == 13 and result.overloaded is not None


def test_a_frame_over_the_limit_sent_while_held_closes_only_that_connection(
    saturated: Callable[..., Any],
) -> None:
    service = saturated()
    rejected = service.server.stats.limits_exceeded
    with socket.create_connection(service.address, timeout=CALLER_TIMEOUT_S) as sock:
        _held(service, sock, 21)
        assert reply(sock)[0] == 22
        sock.sendall(struct.pack("!i", 64 << 20) + b"\x80\x01\x00\x01")
        assert sock.recv(100) == b""  # closed by the server
    assert service.server.stats.limits_exceeded == rejected + 1
    assert service.gate.admission.inflight == 1  # the other caller's call goes on


def test_a_caller_gone_while_held_frees_its_connection(saturated: Callable[..., Any]) -> None:
    service = saturated()
    sock = socket.create_connection(service.address, timeout=CALLER_TIMEOUT_S)
    _held(service, sock, 31)
    assert len(service.server._loop.held) == 1
    sock.close()  # before the held reply is written
    wait_for(lambda: len(service.server._loop.held) == 0, 5, "the connection let go")
    wait_for(lambda: service.server.stats.connections_open == 1, 5, "only the busy one left")


def test_a_drain_answers_the_held_refusals_at_once_instead_of_killing_them(
    saturated: Callable[..., Any],
) -> None:
    service = saturated()
    socks = [socket.create_connection(service.address, timeout=CALLER_TIMEOUT_S) for _ in range(3)]
    retry_after_ms = _held_together(service, socks)
    # Each hold lasts at least 0.9 x retry_after_ms, less a tick of the loop (the deadline
    # allows more): a drain that waited for them would kill them all at a quarter of that.
    report = service.server.stop(timeout_s=0.25 * 0.9 * retry_after_ms / 1000.0)
    for i, sock in enumerate(socks):
        seqid, result = reply(sock)  # answered, not cut off
        assert seqid == 100 * i + 1 and result.overloaded is not None
        assert sock.recv(100) == b""  # then closed
        sock.close()
    # Killed: the hung call, and no held refusal. Those still held when the drain began
    # were answered by it (finished); on a busy machine a hold may have ended just before
    # (its connection then closed idle), so at least one, and all three accounted for.
    assert report.killed == 1 and report.finished >= 1, report
    assert report.finished + report.idle_closed >= 3, report


def _held_together(service: Any, socks: list[socket.socket]) -> int:
    """:func:`_held` for every socket at once (each refused, then called again at once),
    so that no hold ends before the last begins; the least ``retry_after_ms`` told."""
    held = service.server.stats.replies_held
    for i, sock in enumerate(socks):
        sock.sendall(call_frame(100 * i))
    told = []
    for i, sock in enumerate(socks):
        got, result = reply(sock)
        assert got == 100 * i and result.overloaded is not None, result
        told.append(result.overloaded.retry_after_ms)
    for i, sock in enumerate(socks):
        sock.sendall(call_frame(100 * i + 1))
    wait_for(lambda: service.server.stats.replies_held >= held + len(socks), 5, "the calls held")
    return min(told)


def test_a_buffered_connection_is_paced_in_its_own_greenlet(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    service = one_call_at_a_time(
        start_service, slow_alerts, hold=True, **{"server.transport": "buffered"}
    )
    kinds = hammer(service.address, 2.0, transport=TCyBufferedTransport)
    assert service.gate.stats.held >= 1
    assert service.server.stats.replies_held == 0
    assert service.gate.stats.overloaded == sum(k["overloaded"] for k in kinds)


def test_every_held_call_is_recorded_once_in_the_rpc_metric(serve: Any, http_services: Any) -> None:
    """Read in full or refused unread, held or not: each call a caller got an answer to is
    one count of rpc.server.call.duration, with Overloaded as its error.type when refused."""
    server = serve(
        http_services,
        **{
            "metrics.exporter": "prometheus",
            "metrics.port": 0,
            "admission.initial_limit": 1,
            "admission.min_limit": 1,
            "admission.max_limit": 1,
        },
    )
    http_services.alerts.delay_ms = 300
    try:
        kinds: Counter[str] = sum(hammer(("127.0.0.1", server.port), 2.0), Counter())
    finally:
        http_services.alerts.delay_ms = 0
    assert kinds["overloaded"] > CALLERS, kinds  # more than one refusal per caller: held ones
    found = wait_for(
        lambda: re.search(r"Prometheus scrape at (http://\S+/metrics)", server.log()),
        10,
        "the scrape address in the log",
    )
    text = requests.get(found.group(1), timeout=5).text
    counts = {
        error: int(float(n))
        for error, n in re.findall(
            r'^rpc_server_call_duration_seconds_count\{(?=.*rpc_method="AppStats/get_app_stats")'
            r'(?:.*error_type="(\w+)")?.*\} (\S+)$',
            text,
            re.M,
        )
    }
    assert counts.get("Overloaded") == kinds["overloaded"], (counts, kinds)
    assert sum(counts.values()) == kinds["overloaded"] + kinds["answered"], (counts, kinds)


def test_held_replies_due_in_a_turn_of_the_loop_wait_behind_the_calls_due_in_it() -> None:
    """A thousand callers ignoring retry_after_ms come back in waves (held to about the
    same deadline): the calls' I/O due in the same turn of the loop goes first, and the
    held replies after it. Here twenty holds end before a call's timer, all in one turn;
    the call still runs before any held reply is written."""
    held = HeldConnections(
        lambda connection, message: None,
        lambda connection: False,
        1 << 20,
        CallDurations(appstats.AppStats.thrift_services),
    )
    pairs = [socket.socketpair() for _ in range(20)]
    reply = HeldReply("get_app_stats", "Overloaded", time.perf_counter(), b"refused", 0.02)
    holding = [
        gevent.spawn(
            held.hold,
            SimpleNamespace(
                sock=ours,
                channel=SimpleNamespace(idle=False),
                caller=SimpleNamespace(early_for_s=lambda: 0.0),
            ),
            reply,
        )
        for ours, _ in pairs
    ]
    written_when_woken: list[int] = []

    def call() -> None:  # a call waking on its own timer, due after every hold
        gevent.sleep(0.03)
        written_when_woken.append(sum(_unread_bytes(theirs) > 0 for _, theirs in pairs))

    waking = gevent.spawn(call)
    gevent.sleep(0)  # every hold and the call's timer armed
    busy_until = time.perf_counter() + 0.06
    while time.perf_counter() < busy_until:
        pass  # the loop held up: all of them due in its next turn
    gevent.joinall([waking, *holding], timeout=5, raise_error=True)
    assert written_when_woken == [0]
    assert all(_unread_bytes(theirs) == len(reply.payload) for _, theirs in pairs)
    for ours, theirs in pairs:
        ours.close()
        theirs.close()


def test_holds_ending_within_a_tick_are_answered_in_one_turn_of_the_loop() -> None:
    """Twenty holds a millisecond apart end on at most two ticks: their replies are
    written in at most two turns of the loop, not one turn each (one wake-up a tick)."""
    held = HeldConnections(
        lambda connection, message: None,
        lambda connection: False,
        1 << 20,
        CallDurations(appstats.AppStats.thrift_services),
    )
    pairs = [socket.socketpair() for _ in range(20)]
    loop = gevent.get_hub().loop
    turns = [0]
    counting = loop.prepare(ref=False)
    counting.start(lambda: turns.__setitem__(0, turns[0] + 1))
    woken_in_turn: list[int] = []

    def hold(ours: socket.socket, ends_at: float) -> None:
        # Each hold ends at an instant fixed before any greenlet ran: on a busy machine the
        # forty greenlets' starts spread over several turns of the loop (its time moving
        # on between them), and holds counted from each start then spanned a third tick.
        hold_s = max(0.0, ends_at - loop.now())
        reply = HeldReply("get_app_stats", "Overloaded", time.perf_counter(), b"refused", hold_s)
        held.hold(
            SimpleNamespace(
                sock=ours,
                channel=SimpleNamespace(idle=False),
                caller=SimpleNamespace(early_for_s=lambda: 0.0),
            ),
            reply,
        )

    def read(theirs: socket.socket) -> None:
        wait_read(theirs.fileno(), timeout=5)
        woken_in_turn.append(turns[0])

    try:
        start = loop.now()
        # Far enough ahead that no hold has ended before its greenlet runs: under stress
        # the forty starts spread over more than two ticks, and a hold already over was
        # answered at once, in a turn of its own.
        # Held here, one after the other, before any greenlet runs: all twenty within this
        # one turn of the loop, whose time does not move during it. (Spawned, a busy
        # machine spread their starts over turns, and a hold counted from a later turn
        # ended on a later tick.)
        for i, (ours, _) in enumerate(pairs):
            hold(ours, start + 25 * HOLD_TICK_S + 0.001 * (1 + i))
        greenlets = [gevent.spawn(read, theirs) for _, theirs in pairs]
        gevent.joinall(greenlets, timeout=5, raise_error=True)
    finally:
        counting.close()
    assert len(woken_in_turn) == 20 and len(set(woken_in_turn)) <= 2, woken_in_turn
    assert all(_unread_bytes(theirs) == len(b"refused") for _, theirs in pairs)
    for ours, theirs in pairs:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("now", [1_000.0, 1_000.013, 1_795_690_438.0693457])
def test_a_hold_on_the_tick_ends_on_a_tick_never_later_and_at_most_a_tick_sooner(
    now: float,
) -> None:
    loop = SimpleNamespace(now=lambda: now)
    for seconds in (0.0, 0.005, 0.02, 0.0333, 1.7):
        shortened = on_the_tick(loop, seconds)
        ends = now + shortened
        assert 0.0 <= shortened <= seconds and (
            seconds == 0.0 or shortened > seconds - HOLD_TICK_S - 1e-9
        )
        assert shortened == 0.0 or abs(ends / HOLD_TICK_S - round(ends / HOLD_TICK_S)) < 1e-4


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``, read without yielding to the loop."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
