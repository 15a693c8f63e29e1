"""Unit tests of :mod:`service.overload.admission` on a clock the test moves: the queue's
adaptive LIFO and CoDel, refusals, the limit, and ``retry_after_ms`` steering.

No sleeps: waiters are greenlets that block on the queue, ``gevent.sleep(0)`` lets them
reach it, and the test's clock says whether the queue has stood. The load behaviour of
the whole (goodput, latency under overload) is in ``test_overload.py`` and ``make bench``.
"""

from __future__ import annotations

import heapq
from typing import Any

import gevent
import pytest

from lookups.deadline import Deadline
from service.engine.settings import AdmissionSettings
from service.overload.admission import AdmissionControl, Refused
from service.overload.brownout import Criticality
from service.overload.cpu_rule import LULL_CALLS
from service.overload.ticket import CallTicket
from service.testing import FakeClock

#: The ticket of a call of no caller: all that ``done`` reads of it.
ANY_CALL = CallTicket(Deadline.after_s(3600))


def control(clock: FakeClock, **settings: Any) -> AdmissionControl:
    options: dict[str, Any] = {
        "initial_limit": 2,
        "min_limit": 1,
        "max_limit": 100,
        "queue_interval_ms": 60_000,
        "queue_target_ms": 60_000,
        **settings,
    }
    return AdmissionControl(AdmissionSettings(**options), request_deadline_ms=2000, clock=clock)


def lulling(admission: AdmissionControl) -> bool:
    """Whether a lull to learn the least latency runs (read anew each time: it changes as calls end)."""
    return admission.cpu.least.lulling


def far() -> Deadline:
    return Deadline.after_ms(60_000)


def steady(admission: AdmissionControl, inflight: int, latency_s: float, calls: int = 200) -> None:
    """``inflight`` calls admitted, then ``calls`` ending after ``latency_s``, each slot
    taken again at once."""
    for _ in range(inflight):
        admission.admit(CallTicket(far()))
    for _ in range(calls):
        admission.done(ANY_CALL, latency_s)
        admission.admit(CallTicket(far()))


def queue(admission: AdmissionControl, names: list[str], order: list[str]) -> list[gevent.Greenlet]:
    """One waiter per name, queued in that order; each appends its name once admitted."""

    def wait(name: str) -> None:
        admission.admit(CallTicket(far()))
        order.append(name)

    waiters = []
    for name in names:
        waiters.append(gevent.spawn(wait, name))
        gevent.sleep(0)  # it reaches the queue before the next one is spawned
    return waiters


def release(admission: AdmissionControl, count: int) -> None:
    for _ in range(count):
        admission.done(ANY_CALL, 0.01)
        gevent.sleep(0)


def test_a_queue_that_drained_recently_is_served_first_in_first_out() -> None:
    clock = FakeClock()
    admission = control(clock, initial_limit=3)  # the queue holds as many
    for _ in range(3):
        admission.admit(CallTicket(far()))
    assert admission.saturated
    order: list[str] = []
    waiters = queue(admission, ["a", "b", "c"], order)
    assert admission.queued == 3
    release(admission, 3)
    gevent.joinall(waiters, raise_error=True)
    assert order == ["a", "b", "c"]


def test_a_standing_queue_serves_the_newest_first() -> None:
    clock = FakeClock()
    admission = control(clock, queue_interval_ms=100, initial_limit=3)
    for _ in range(3):
        admission.admit(CallTicket(far()))
    order: list[str] = []
    clock.advance(0.09)  # the line empty for most of its interval...
    waiters = queue(admission, ["a", "b", "c"], order)
    clock.advance(0.02)  # ...then standing: not empty for longer than queue_interval_ms,
    release(admission, 3)  # while its waiters, there 20 ms of their 100, still wait
    gevent.joinall(waiters, raise_error=True)
    assert order == ["c", "b", "a"]


def test_codel_cuts_the_wait_once_the_queue_stands() -> None:
    """Arriving at a standing queue, a waiter waits queue_target_ms (here 0: refused at once
    when nothing finishes) instead of queue_interval_ms."""
    clock = FakeClock()
    admission = control(clock, queue_interval_ms=100, queue_target_ms=0)
    admission.admit(CallTicket(far()))
    admission.admit(CallTicket(far()))
    order: list[str] = []
    clock.advance(0.09)
    patient = queue(admission, ["patient"], order)  # the queue has just formed: a long wait
    clock.advance(0.02)  # ...and now it has stood too long
    with pytest.raises(Refused, match="no call finished while this one waited"):
        admission.admit(CallTicket(far()))
    assert admission.stats.refused_queue == 1
    release(admission, 1)
    gevent.joinall(patient, raise_error=True)
    assert order == ["patient"]


def test_without_fair_share_codel_cuts_every_callers_wait() -> None:
    """With ``admission.fair_share`` off no caller is "under its share": a standing line
    cuts the wait of every waiter, named callers' too."""
    clock = FakeClock()
    admission = control(clock, queue_interval_ms=100, queue_target_ms=0, fair_share=False)
    caller = admission.arrived("polite")
    admission.admit(CallTicket(far(), caller=caller))
    admission.admit(CallTicket(far(), caller=caller))
    clock.advance(0.09)
    patient = queue(admission, ["patient"], [])
    clock.advance(0.02)
    with pytest.raises(Refused, match="no call finished while this one waited"):
        admission.admit(CallTicket(far(), caller=admission.arrived("polite")))
    release(admission, 1)
    gevent.joinall(patient, raise_error=True)


def test_a_full_queue_refuses_at_once() -> None:
    clock = FakeClock()
    admission = control(clock)
    admission.admit(CallTicket(far()))
    admission.admit(CallTicket(far()))
    order: list[str] = []
    waiters = queue(admission, ["a", "b"], order)  # the queue holds as many as the limit
    with pytest.raises(Refused, match="queue is full") as refused:
        admission.admit(CallTicket(far()))
    assert refused.value.retry_after_ms > 0
    assert (admission.stats.refused, admission.stats.refused_queue) == (1, 1)
    release(admission, 2)
    gevent.joinall(waiters, raise_error=True)


def test_a_call_that_cannot_finish_in_time_is_refused_without_queueing() -> None:
    clock = FakeClock()
    admission = control(clock)
    for _ in range(2):
        admission.admit(CallTicket(far()))
    for _ in range(8):  # calls take 0.5 s now
        admission.done(ANY_CALL, 0.5)
        admission.admit(CallTicket(far()))
    with pytest.raises(Refused, match="cannot finish within its deadline"):
        admission.admit(CallTicket(Deadline.after_ms(100)))
    assert admission.stats.refused_deadline == 1 and admission.queued == 0


def _window(
    admission: AdmissionControl,
    clock: FakeClock,
    admitted: int,
    refused: int,
    criticality: Criticality = Criticality.CRITICAL,
) -> int:
    """One second of traffic with this many admissions and refusals of ``criticality``;
    retry_after_ms for it after that second."""
    for _ in range(admitted):
        admission._admitted(int(criticality))
        admission.inflight -= 1
    for _ in range(refused):
        admission.refuse_unread(criticality)
    clock.now += 1.0
    admission.refuse_unread(criticality)  # the next event rolls the window
    return admission.retry_after_ms(criticality)


def test_a_flood_of_sheddable_refusals_does_not_send_critical_callers_away() -> None:
    """retry_after_ms is steered apart for the critical and the sheddable calls."""
    clock = FakeClock()
    admission = control(clock)
    critical = admission.retry_after_ms(Criticality.CRITICAL)
    sheddable = _window(
        admission, clock, admitted=0, refused=2500, criticality=Criticality.SHEDDABLE
    )
    assert sheddable == pytest.approx(critical * 22.4, rel=0.05)  # sqrt(2500 / 5 aimed at)
    assert admission.retry_after_ms(Criticality.SHEDDABLE_PLUS) == sheddable
    assert admission.retry_after_ms(Criticality.CRITICAL) <= critical
    assert admission.retry_after_ms(Criticality.CRITICAL_PLUS) <= critical


def test_calls_the_dimmer_sheds_steer_retry_after_but_are_not_admissions_refusals() -> None:
    """The dimmer follows admission's own refusals, so its sheds are not among them; but
    the callers it sheds are told when to come back, and that pause grows as any other."""
    clock = FakeClock()
    admission = control(clock)
    start = admission.retry_after_ms(Criticality.SHEDDABLE)
    for _ in range(500):
        told = admission.shed(Criticality.SHEDDABLE)
    assert told == start
    clock.now += 1.0
    grown = admission.shed(Criticality.SHEDDABLE)  # the next event rolls the window
    assert grown == pytest.approx(start * 10, rel=0.05)  # sqrt(500 / 5 aimed at)
    assert admission.refusals_decided == 0 and admission.stats.refused == 0
    assert admission.retry_after_ms(Criticality.CRITICAL) <= start


def test_retry_after_grows_while_refusals_outnumber_a_quarter_of_admissions() -> None:
    clock = FakeClock()
    admission = control(clock)
    start = admission.retry_after_ms()
    grown = _window(admission, clock, admitted=100, refused=2500)  # 25 refusals aimed at
    assert grown == pytest.approx(start * 10, rel=0.05)  # sqrt(2500 / 25)
    assert _window(admission, clock, admitted=100, refused=100_000) == 10_000  # the cap


def test_retry_after_halves_without_refusals_down_to_its_floor() -> None:
    clock = FakeClock()
    admission = control(clock)
    values = []
    for _ in range(8):
        for _ in range(50):
            admission._admitted(int(Criticality.CRITICAL))
            admission.inflight -= 1
        clock.now += 1.0
        admission._admitted(int(Criticality.CRITICAL))
        admission.inflight -= 1
        values.append(admission.retry_after_ms())
    assert values[:2] == [50, 25] and values[-1] == 20  # halves, floored at 20 ms


def test_the_limit_falls_when_latency_jumps_and_grows_while_it_holds() -> None:
    clock = FakeClock()
    admission = control(clock, initial_limit=20)
    steady(admission, 20, 0.02)
    settled = admission.limit
    assert settled > 20 and admission.stats.latency_cuts == 0
    cuts = []
    for _ in range(40):  # latency ten times as high: a call ends every 10 ms
        clock.now += 0.01
        before = admission.limit
        admission.done(ANY_CALL, 0.2)
        admission.admit(CallTicket(far())) if admission.inflight < int(admission.limit) else None
        if admission.limit < before:
            cuts.append(round(admission.limit / before, 2))
    assert admission.limit < settled * 0.6
    # Never more than half at once.
    assert cuts and min(cuts) >= 0.5, cuts
    assert admission.stats.latency_cuts >= 1  # what the brownout dimmer reads


def test_latency_cuts_are_counted_once_a_round() -> None:
    """The updates of one round (a typical call's latency) cut once, however many see the
    latency high: so the dimmer sees one signal per round, not one per few calls."""
    clock = FakeClock()
    admission = control(clock, initial_limit=20)
    steady(admission, 20, 0.02)
    for _ in range(60):  # latency ten times as high, within one round (the clock stands)
        admission.done(ANY_CALL, 0.2)
        admission.admit(CallTicket(far())) if admission.inflight < int(admission.limit) else None
    assert admission.stats.latency_cuts == 1
    clock.now += 1.0  # a round later, higher again
    for _ in range(20):
        admission.done(ANY_CALL, 2.0)
        admission.admit(CallTicket(far())) if admission.inflight < int(admission.limit) else None
    assert admission.stats.latency_cuts == 2


def test_a_disabled_control_admits_everything() -> None:
    admission = control(FakeClock(), enabled=False, initial_limit=1)
    for _ in range(50):
        admission.admit(CallTicket(Deadline.after_ms(1)))
    assert admission.inflight == 50 and not admission.saturated


def test_refusals_without_a_queue_still_let_a_small_limit_grow() -> None:
    """Callers back too early are refused unread (pacing), never queued. At the smallest
    limit the refusals are the only sign of demand; without counting them the limit stayed
    at 2 with the process nearly idle (seen under 1,000 callers ignoring retry_after_ms)."""
    clock = FakeClock()
    admission = control(clock, initial_limit=2, min_limit=2)
    for _ in range(2):
        admission.admit(CallTicket(far()))
    for _ in range(200):  # steady latency; each slot freed or added is taken at once
        for _ in range(5):
            admission.refuse_unread()
        admission.done(ANY_CALL, 0.2)
        while admission.inflight < int(admission.limit):
            admission.admit(CallTicket(far()))
    assert admission.limit > 10 and admission.queued == 0


def test_callers_the_dimmer_refuses_unread_are_no_demand_for_the_limit() -> None:
    """Below the limit a caller is refused unread only because the brownout dimmer refuses
    its kind: that says nothing of admission's limit, which must not grow on it (it grew
    to 657 of 1,000 beside 1,000 sheddable callers while 50 were in flight)."""
    clock = FakeClock()
    admission = control(clock, initial_limit=20)
    for _ in range(2):
        admission.admit(CallTicket(far()))
    for _ in range(200):  # steady latency, far below the limit
        for _ in range(5):
            admission.refuse_unread(Criticality.SHEDDABLE)
        admission.done(ANY_CALL, 0.2)
        admission.admit(CallTicket(far()))
    assert admission.limit == 20 and admission.stats.refused_unread == 1000


class CpuDemand:
    """The loop's demand for a core, in seconds so far, as the test's clock runs at ``busy``."""

    def __init__(self, clock: FakeClock, busy: float) -> None:
        self.clock, self.busy, self.started = clock, busy, clock.now

    def __call__(self) -> float:
        return (self.clock.now - self.started) * self.busy


def limit_after_steady_load(
    busy: float, in_use: int = 0, least_s: float = 0.02, **settings: Any
) -> tuple[float, float]:
    """The limit before and after 2,000 calls, 10 ms apart on the test's clock, with every
    slot in use (or ``in_use`` calls in flight), while the loop wants a core ``busy`` of the
    time: calls of 50 ms, every tenth of ``least_s`` (one that met no queue)."""
    clock = FakeClock()
    admission = cpu_bound(clock, busy, **{"max_limit": 200, **settings})
    before = admission.limit
    steady_load(admission, clock, 2000, 0.01, in_use, least_s)
    return before, admission.limit


def cpu_bound(clock: FakeClock, busy: float, **settings: Any) -> AdmissionControl:
    """Admission from a limit of 40 on the test's clock, while the loop wants a core
    ``busy`` of the time."""
    options: dict[str, Any] = {"initial_limit": 40, "min_limit": 2, **settings}
    return AdmissionControl(
        AdmissionSettings(**options),
        request_deadline_ms=2000,
        clock=clock,
        cpu_demand=CpuDemand(clock, busy),
    )


def steady_load(
    admission: AdmissionControl,
    clock: FakeClock,
    calls: int,
    apart_s: float,
    in_use: int = 0,
    least_s: float = 0.02,
) -> float:
    """``calls`` calls of 50 ms each, every tenth of ``least_s``, one ending every
    ``apart_s`` on the test's clock, with every slot in use (or ``in_use`` calls in
    flight); the limit after them."""
    for number in range(calls):
        while not admission.saturated and (not in_use or admission.inflight < in_use):
            admission.admit(CallTicket(far()))
        clock.now += apart_s
        admission.done(ANY_CALL, least_s if number % 10 == 9 else 0.05)
    return admission.limit


def test_the_limit_falls_while_the_loop_is_cpu_saturated_and_grows_while_it_is_not() -> None:
    before, saturated = limit_after_steady_load(busy=1.0)
    assert saturated < 0.5 * before  # latency held still: only the CPU says too many
    before, spare = limit_after_steady_load(busy=0.8)
    assert spare > 1.5 * before
    # Off: latency alone decides, and steady latency lets the limit grow.
    before, ignored = limit_after_steady_load(busy=1.0, cpu_saturated=0.0)
    assert ignored > 1.5 * before
    # Saturated by something else, with the limit far from in use: it is left alone.
    before, unused = limit_after_steady_load(busy=1.0, in_use=5)
    assert unused == before


def test_a_saturated_loop_holds_the_limit_while_calls_queue_about_as_long_as_they_run() -> None:
    """Fewer calls than keep a core saturated at twice the least latency each cost more of
    it: with 50 callers and 20 ms backends, a limit of 12 kept the loop as busy as 20 but
    answered a seventh fewer calls. The CPU rule cuts past 2.2 times the least latency,
    grows a step below 1.6 times, and holds between."""

    def limits(least_s: float) -> tuple[float, float]:
        clock = FakeClock()
        admission = cpu_bound(clock, busy=1.0)
        measured = steady_load(admission, clock, 100, 0.01, least_s=least_s)  # a window measured
        return measured, steady_load(admission, clock, 1900, 0.01, least_s=least_s)

    measured, held = limits(least_s=0.025)  # calls of 47.5 ms on average: 1.9 times
    assert held == measured
    measured, cut = limits(least_s=0.02)  # 2.35 times
    assert cut < 0.5 * measured
    measured, grown = limits(least_s=0.032)  # 1.5 times
    assert grown > 1.5 * measured


def test_a_lull_learns_the_least_latency_a_high_limit_hid() -> None:
    """Calls that queue for a saturated core take longer the more are in flight, so a
    least latency learnt from them is only as low as the limit: one learnt at a limit of
    30 held 30, where 20 answered more. Once an epoch a lull lets only a few calls in
    flight, and learns the call's own latency, whatever the limit."""
    clock = FakeClock()
    admission = cpu_bound(clock, busy=1.0, initial_limit=60, max_limit=200)
    ends: list[tuple[float, float]] = []  # (when it ends, its latency), for calls in flight
    most_in_lull = 0
    for _ in range(6000):
        while not admission.saturated:
            admission.admit(CallTicket(far()))
            latency_s = 0.01 + 0.002 * admission.inflight  # the core's queue: 2 ms a call
            heapq.heappush(ends, (clock.now + latency_s, latency_s))
            if admission.cpu.least.lulling:
                most_in_lull = max(most_in_lull, admission.inflight)
        clock.now, latency_s = heapq.heappop(ends)
        admission.done(ANY_CALL, latency_s)
    assert admission.cpu.least.lulls >= 2 and most_in_lull <= LULL_CALLS
    assert admission.cpu.least.seconds <= 0.01 + 0.002 * LULL_CALLS  # the call's own latency
    # ...and the limit holds a queue for the core of 0.6 to 1.2 times the rest of a call.
    assert 1.6 * 0.9 <= admission.cpu.window_latency_s / admission.cpu.least.seconds <= 2.2 / 0.9


def test_a_saturated_loop_takes_the_limit_down_one_step_per_window_measured() -> None:
    """A call ends every millisecond: about twenty updates a window of the loop's demand.
    A step at every update took the limit down by half within one window, and it then
    swung back as far: the core sat idle between the swings."""
    clock = FakeClock()
    admission = cpu_bound(clock, busy=1.0)
    first = steady_load(admission, clock, 260, 0.001)  # the first window measured: one step
    assert lulling(admission)
    while lulling(admission):  # ...and a lull, which moves nothing
        steady_load(admission, clock, 1, 0.001)
    assert admission.limit == first
    assert steady_load(admission, clock, 540, 0.001) == pytest.approx(first * 0.9**2)  # two more


def test_a_loop_close_to_saturated_grows_the_limit_one_step_per_window_measured() -> None:
    """A window with a moment to spare on a loop close to saturated (a lull's aftermath,
    a pause of the callers): grown at every update, the limit went from 18 to 37 within
    one window."""
    clock = FakeClock()
    admission = cpu_bound(clock, busy=0.93)
    first = steady_load(admission, clock, 260, 0.001)  # the first window measured
    assert steady_load(admission, clock, 540, 0.001) == pytest.approx(first / 0.9**2)


def test_a_limit_just_past_twice_the_calls_in_use_still_falls_when_they_saturate_the_loop() -> None:
    """Fifty callers against a limit of 101: too little in use for the limit to grow, yet
    the calls keep the loop saturated. The limit fell nowhere, and the process ran at 100%
    with every call waiting on the core."""
    before, saturated = limit_after_steady_load(busy=1.0, in_use=50, initial_limit=101)
    assert saturated < 0.5 * before
    before, spare = limit_after_steady_load(busy=0.8, in_use=50, initial_limit=101)
    assert spare == pytest.approx(before)  # not saturated, and too little in use to grow


def test_a_call_that_says_nothing_of_latency_is_left_out() -> None:
    """Calls whose every panel failed at once (an open circuit) end in a millisecond; had
    they counted, every real call afterwards would look two hundred times slower."""
    from service.overload.gate import CallGate

    clock = FakeClock()
    gate = CallGate(AdmissionSettings(initial_limit=20), 2000)
    admission = gate.admission
    admission._clock = clock
    for _ in range(50):
        admission.admit(CallTicket(far()))
        admission.done(ANY_CALL, 0.2)
    short, long, limit = admission._short_s, admission._long_s, admission.limit
    for _ in range(200):
        with gate.admitted(far()) as call:
            call.measured = False
    assert (admission._short_s, admission._long_s, admission.limit) == (short, long, limit)
    assert admission.inflight == 0 and admission.stats.admitted == 250


@pytest.mark.parametrize(
    ("statuses", "measured"),
    [
        (["OK", "OK", "OK"], True),
        (["OK", "TIMEOUT"], True),  # slow: what the limit is for
        (["OK", "REJECTED"], True),  # no pool slot in time: the load
        (["OK", "ERROR"], False),  # an open circuit, or a server down
        (["OK", "CANCELLED", "ERROR"], False),
        (["ERROR", "ERROR"], False),
    ],
)
def test_only_a_call_whose_tasks_did_their_work_or_ran_out_of_time_is_measured(
    statuses: list[str], measured: bool
) -> None:
    from service.engine.tasks import TaskStatus
    from service.overload.gate import AdmittedCall

    call = AdmittedCall(CallTicket(far()), lighter=False)
    call.ran(TaskStatus[status] for status in statuses)
    assert call.measured is measured


def test_a_call_whose_required_panel_failed_is_left_out() -> None:
    from service.engine.tasks import RequiredTaskFailed
    from service.overload.gate import CallGate

    gate = CallGate(AdmissionSettings(initial_limit=20), 2000)
    admission = gate.admission
    for _ in range(50):
        admission.admit(CallTicket(far()))
        admission.done(ANY_CALL, 0.2)
    before = (admission._short_s, admission._long_s, admission.limit)
    for _ in range(20):
        with pytest.raises(RequiredTaskFailed), gate.admitted(far()):
            raise RequiredTaskFailed.__new__(RequiredTaskFailed)
    assert (admission._short_s, admission._long_s, admission.limit) == before
    assert admission.inflight == 0


def test_slow_calls_ending_together_cut_the_limit_once_not_again_and_again() -> None:
    """The calls admitted since a cut have not ended: the same latency cuts once per round."""
    clock = FakeClock()
    admission = control(clock, initial_limit=40)
    steady(admission, 40, 0.01, calls=100)
    before = admission.limit
    for _ in range(30):  # thirty slow calls end in the same instant
        admission.done(ANY_CALL, 0.5)
    assert before / 2 <= admission.limit < before
    clock.now += 1.0  # a round later, the next cut may come
    for _ in range(8):
        admission.admit(CallTicket(far()))
        admission.done(ANY_CALL, 0.5)
    assert admission.limit < before / 2


def test_room_to_spare_is_no_wait_and_at_most_half_the_limit_in_flight_since_the_last_look() -> (
    None
):
    clock = FakeClock()
    admission = control(clock, initial_limit=10)
    for _ in range(5):
        admission.admit(CallTicket(far()))
    assert admission.room_to_spare()  # five of ten
    admission.admit(CallTicket(far()))
    for _ in range(6):
        admission.done(ANY_CALL, None)
    assert not admission.room_to_spare()  # six were in flight since the last look
    assert admission.room_to_spare()  # none since
    for _ in range(10):
        admission.admit(CallTicket(far()))
    waiter = gevent.spawn(admission.admit, far())
    gevent.sleep(0)  # it waits in the line
    for _ in range(10):
        admission.done(ANY_CALL, None)
    waiter.join(timeout=5)
    admission.done(ANY_CALL, None)
    assert not admission.room_to_spare()  # a call waited
    assert admission.room_to_spare()
