"""Pacing: callers that ignore retry_after_ms are refused a bounded number of times."""

from __future__ import annotations

import socket
import time
from collections import Counter
from typing import Any

import gevent
import pytest

from lookups.deadline import Deadline
from service.client import AppStatsClient
from service.idl import appstats
from service.overload.pacing import ConnectionPacing
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.samples.faults import FaultyHttpService
from service.testing import FakeClock
from tests.support.pacing import (
    CALLER_TIMEOUT_S,
    CALLERS,
    call_frame,
    hammer,
    impatient_caller,
    one_call_at_a_time,
    reply,
)

pytestmark = pytest.mark.solo  # make test runs it alone: tests/parallel.py


def test_a_caller_back_early_is_held_within_its_deadline_and_a_polite_one_is_not() -> None:
    pacing = ConnectionPacing()
    pacing.arrived(Deadline.after_ms(300))
    assert pacing.refused(10_000, Deadline.after_ms(300)) == 0.0  # nothing known yet

    pacing.arrived(Deadline.after_ms(300))  # straight back, told to wait 10 s
    held_s = pacing.refused(10_000, Deadline.after_ms(300))
    assert 0.9 * (0.95 * 0.3 - 0.05) - 0.01 <= held_s <= 0.95 * 0.3 - 0.05

    pacing.arrived(Deadline.after_ms(300))
    held_s = pacing.refused(40, Deadline.after_ms(2000))
    assert 0 < held_s <= 0.040  # never past retry_after_ms
    assert pacing.take_hold() == held_s and pacing.take_hold() == 0.0  # the server holds it
    # Answered when the hold ends, a caller honouring x0.6 of the 40 ms it was told.
    gevent.sleep(held_s + 0.040 * 0.6)
    pacing.arrived(Deadline.after_ms(300))
    assert pacing.refused(40, Deadline.after_ms(2000)) == 0.0

    pacing.answered()
    pacing.arrived(Deadline.after_ms(300))
    assert pacing.refused(10_000, Deadline.after_ms(2000)) == 0.0  # answered since: a new start


def test_callers_ignoring_retry_after_are_held_at_every_early_comeback(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    # Both servers' clocks stand still (service/testing.py): a caller straight back after a
    # refusal is early however long a busy machine took to send it, so a paced one is held.
    unpaced = one_call_at_a_time(start_service, slow_alerts, hold=False, clock=FakeClock())
    unpaced_kinds = hammer(unpaced.address, 2.0)
    assert unpaced.gate.stats.held == 0

    paced = one_call_at_a_time(start_service, slow_alerts, hold=True, clock=FakeClock())
    paced_kinds = hammer(paced.address, 2.0)

    refused = sum(k["overloaded"] for k in paced_kinds)
    answered = sum(k["answered"] for k in paced_kinds)
    assert answered >= 1 and refused >= CALLERS
    assert paced.gate.stats.overloaded == refused
    # Held: every refusal but a connection's first and the first after each answer, as the
    # clock stands and every comeback is early. Without pacing: none. So a paced caller
    # comes back at the pace of its holds, an unpaced one at the pace of its round trips:
    # refused many times as often on a quiet machine, about as often beside two CPU
    # hogs, so no count is compared here; the holds are the behaviour.
    assert paced.gate.stats.held >= refused - CALLERS - answered > 0
    assert sum(k["overloaded"] for k in unpaced_kinds) >= CALLERS


def test_callers_honouring_retry_after_are_never_held(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    service = one_call_at_a_time(start_service, slow_alerts, hold=True)

    def polite() -> Counter[str]:
        kinds: Counter[str] = Counter()
        # A client that sleeps retry_after_ms x U(0.5, 1.5), within its deadline and budget.
        with AppStatsClient(
            *service.address, pool_size=1, timeout_ms=3000, overload_retry_ratio=1.0
        ) as client:
            ends = time.monotonic() + 2.0
            while time.monotonic() < ends:
                try:
                    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                    kinds["answered"] += 1
                except appstats.Overloaded as overloaded:
                    kinds["overloaded"] += 1
                    gevent.sleep(overloaded.retry_after_ms / 1000.0)
        return kinds

    callers = [gevent.spawn(polite) for _ in range(8)]
    gevent.joinall(callers, timeout=20)
    kinds: Counter[str] = sum((c.get() for c in callers), Counter())
    assert service.gate.stats.overloaded >= 8 and kinds["answered"] >= 1
    assert service.gate.stats.held == 0


def test_a_caller_back_early_while_saturated_is_refused_unread_with_its_own_seqid(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    service = one_call_at_a_time(start_service, slow_alerts, hold=True)
    busy = gevent.spawn(impatient_caller, service.address, 2.0)  # keeps the one slot taken
    gevent.sleep(0.2)
    with socket.create_connection(service.address, timeout=CALLER_TIMEOUT_S) as sock:
        answers = []
        for seqid in range(41, 47):  # back at once after each answer, as a retry loop would be
            sock.sendall(call_frame(seqid))
            answers.append(reply(sock))
    busy.get()
    assert [seqid for seqid, _ in answers] == list(range(41, 47))
    # The busy caller leaves the slot free now and then (more often on a loaded machine), so
    # a call may be answered; every other answer is an Overloaded with a retry_after_ms.
    refusals = [result.overloaded for _, result in answers if result.success is None]
    assert all(r is not None and r.retry_after_ms > 0 for r in refusals), answers
    unread = ["without being read" in r.message for r in refusals]
    # A connection is refused unread only once it was refused after a read: it came back early.
    assert True in unread and unread[0] is False, answers
    assert service.gate.admission.stats.refused_unread >= unread.count(True)


def test_the_web_tier_client_rests_a_connection_told_to_wait_so_it_is_never_held(
    start_service: Any, slow_alerts: FaultyHttpService
) -> None:
    """Many calls through one pooled client: a connection answered Overloaded is not lent
    again before its retry_after_ms, so no call of this client is held by pacing."""
    service = one_call_at_a_time(start_service, slow_alerts, hold=True)
    kinds: Counter[str] = Counter()
    with AppStatsClient(
        *service.address, pool_size=4, timeout_ms=3000, overload_retry_ratio=1.0
    ) as client:

        def web_requests() -> None:
            ends = time.monotonic() + 2.0
            while time.monotonic() < ends:
                try:
                    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                    kinds["answered"] += 1
                except appstats.Overloaded:
                    kinds["overloaded"] += 1  # a web request that renders an error, then the next

        callers = [gevent.spawn(web_requests) for _ in range(8)]
        gevent.joinall(callers, timeout=20, raise_error=True)
    assert service.gate.stats.overloaded >= 8 and kinds["answered"] >= 1, kinds
    assert service.gate.stats.held == 0
