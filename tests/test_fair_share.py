"""Fair share per caller (:mod:`service.overload.fair_share`) on a clock the test moves:
who is refused first and in which order, with and without weights, borrowing, bounded
state and exact counts by label.

As in ``test_admission.py``: waiters are greenlets blocked in the admission line,
``gevent.sleep(0)`` lets them reach it; nothing waits on the wall clock. The shares
under real load are ``make bench``'s (``bench/harness/fair_share.py``).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import gevent
import pytest

from lookups.backends.ordered_slots import OrderedSlots
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.flow import Flow
from lookups.panels import AlertList, Window
from lookups.registry import LookupRegistry
from service.client import AppStatsClient
from service.engine.settings import AdmissionSettings
from service.engine.tasks import FanOutOverloaded
from service.overload.admission import AdmissionControl, Refused
from service.overload.brownout import Criticality
from service.overload.fair_share import ACTIVE_S, OTHER, RATE_WINDOW_S, FairShare
from service.overload.gate import CallGate
from service.overload.pacing import ConnectionPacing
from service.overload.ticket import CallTicket
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.testing import FakeClock
from tests.support.samples import StartService
from tracing.context import spawn_in_context


def control(clock: FakeClock, weights: dict[str, float] | None = None, **settings: Any):
    options: dict[str, Any] = {
        "initial_limit": 4,
        "min_limit": 1,
        "max_limit": 100,
        "queue_interval_ms": 60_000,
        "queue_target_ms": 60_000,
        **settings,
    }
    return AdmissionControl(
        AdmissionSettings(**options), request_deadline_ms=2000, clock=clock, weights=weights
    )


def far() -> Deadline:
    return Deadline.after_ms(60_000)


class Callers:
    """Calls of named callers through one admission control, as the gate makes them."""

    def __init__(self, admission: AdmissionControl) -> None:
        self.admission = admission
        self.running: dict[str, list[Any]] = {}
        self.order: list[str] = []
        self.refused: list[str] = []

    def admit(self, name: str) -> None:
        """A call of ``name`` admitted at once (the test knows the limit is not reached)."""
        share = self.admission.arrived(name)
        self.admission.admit(CallTicket(far(), caller=share))
        self.running.setdefault(name, []).append(share)

    def wait(self, name: str) -> gevent.Greenlet:
        """A call of ``name`` that joins the line; its name is appended once admitted."""

        def call() -> None:
            share = self.admission.arrived(name)
            try:
                self.admission.admit(CallTicket(far(), caller=share))
            except Refused:
                self.refused.append(name)
                return
            self.order.append(name)
            self.running.setdefault(name, []).append(share)

        waiter = gevent.spawn(call)
        gevent.sleep(0)  # it reaches the line before the next one is spawned
        return waiter

    def end(self, name: str) -> None:
        self.admission.done(CallTicket(far(), caller=self.running[name].pop()), 0.01)
        gevent.sleep(0)


def test_a_caller_under_its_share_is_admitted_past_the_limit_the_storm_reached() -> None:
    """As a partition under its limit is in concurrency-limits' partitioned limiters: the
    limit was reached by the caller over its share, and this one's share is its own."""
    clock = FakeClock()
    callers = Callers(control(clock))
    for _ in range(4):
        callers.admit("storm")  # alone, the storm may take the whole limit (borrowing)
    assert callers.admission.saturated
    late = [callers.wait("storm"), callers.wait("storm")]
    polite = callers.wait("polite")  # under its share (0 of 2): admitted at once
    assert callers.order == ["polite"] and polite.dead and callers.admission.inflight == 5
    callers.end("storm")  # 4 in flight: still the limit, no waiter let in
    assert callers.order == ["polite"]
    callers.end("storm")
    callers.end("storm")
    gevent.joinall(late, raise_error=True)
    assert callers.order == ["polite", "storm", "storm"]


def test_with_fair_share_off_the_line_is_first_come_first_served() -> None:
    clock = FakeClock()
    callers = Callers(control(clock, fair_share=False))
    for _ in range(4):
        callers.admit("storm")
    late = [callers.wait("storm"), callers.wait("storm")]
    polite = callers.wait("polite")
    for _ in range(3):
        callers.end("storm")
    gevent.joinall([polite, *late], raise_error=True)
    assert callers.order == ["storm", "storm", "polite"]


def test_what_a_caller_under_its_share_takes_past_the_limit_is_bounded_by_its_share() -> None:
    clock = FakeClock()
    callers = Callers(control(clock))
    for _ in range(4):
        callers.admit("storm")
    storm = [callers.wait("storm") for _ in range(4)]  # the line holds as many as the limit
    callers.wait("polite")
    callers.wait("polite")  # 1 of its share of 2: admitted at once too
    assert callers.order == ["polite", "polite"] and callers.admission.inflight == 6
    third = callers.wait("polite")  # at its share: over it, behind a full line
    share = callers.admission.arrived("storm")
    with pytest.raises(Refused, match="queue is full"):
        callers.admission.admit(CallTicket(far(), caller=share))  # over its share, behind everyone
    third.join(timeout=5)
    assert callers.refused == ["polite"] and callers.admission.inflight == 6
    for name in ("polite", "polite", "storm", "storm", "storm", "storm"):
        callers.end(name)
    gevent.joinall(storm, raise_error=True)
    assert callers.order == ["polite", "polite", *["storm"] * 4]


def test_a_standing_line_cuts_the_wait_of_callers_over_their_share() -> None:
    """The standing line is the storm's: its newcomers' waits are cut, its first waiter's
    ends at queue_interval_ms; a polite caller is admitted at once all the while."""
    clock = FakeClock()
    callers = Callers(control(clock, queue_interval_ms=100, queue_target_ms=0))
    for _ in range(4):
        callers.admit("storm")
    clock.advance(0.05)  # the line, empty since it was made, is about to stand
    first = callers.wait("storm")  # it may wait queue_interval_ms, to 0.15 s
    clock.advance(0.06)  # the line has stood longer than queue_interval_ms: CoDel cuts waits
    late = callers.wait("storm")  # over its share: refused when nothing ends at once
    polite = callers.wait("polite")  # under its share: admitted past the limit
    late.join(timeout=5)  # its wait of 0 ends on the loop's next turn
    assert callers.refused == ["storm"] and callers.order == ["polite"] and polite.dead
    assert not first.dead  # its own wait is not over...
    clock.advance(0.05)  # ...until queue_interval_ms from when it came
    first.join(timeout=5)
    assert callers.refused == ["storm", "storm"]


def test_a_caller_with_calls_waiting_is_over_its_share_however_few_run() -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=100, clock=clock)
    storm, polite = shares.arrived("storm"), shares.arrived("polite")
    storm.inflight, storm.waiting = 1, 40
    assert shares.over(storm, 10.0)  # 41 asked for, of a share of 5
    polite.inflight = 1
    assert not shares.over(polite, 10.0)


def test_a_caller_asking_for_less_than_its_share_of_the_rate_is_within_it_in_a_burst() -> None:
    """Counts alone put a polite caller over its share whenever its calls bunch up beside a
    storm; once the rates of a whole window are known, one asking for fewer calls a second
    than its share of those admitted is within it, and a storm asking for more is over."""
    clock = FakeClock()
    shares = FairShare({}, max_callers=100, clock=clock)

    def second(storm_asks: int, polite_asks: int, admitted: int) -> tuple[Any, Any]:
        """A second of calls, in tenths: both callers stay active throughout."""
        for _ in range(10):
            for _ in range(storm_asks // 10):
                storm = shares.arrived("storm")
            for _ in range(polite_asks // 10):
                polite = shares.arrived("polite")
            for _ in range(admitted // 10):
                shares.admitted(storm)
                shares.done(storm)
            clock.advance(RATE_WINDOW_S / 10)
        return storm, polite

    # The first window: the callers were not tracked for all of it, the counts decide.
    clock.advance(RATE_WINDOW_S / 2)
    storm, polite = second(1000, 30, 100)
    polite.inflight, storm.inflight, storm.waiting = 6, 4, 40
    assert polite.asked_per_s is None
    assert shares.over(polite, 10.0) and shares.over(storm, 10.0)  # 6 of a share of 5
    # The next: both were tracked the whole window. The polite caller asked 30 a second of
    # a share of 50 (half the 100 admitted): within it, whatever its count. The storm asked
    # 1,000: over.
    storm, polite = second(1000, 30, 100)
    assert polite.asked_per_s is not None
    assert not shares.over(polite, 10.0) and shares.over(storm, 10.0)
    # Asking for more than its share of the rate, it is over its share again.
    storm, polite = second(1000, 80, 100)
    assert shares.over(polite, 10.0)
    # Under its share by count, it is within it whatever its rate.
    polite.inflight = 2
    assert not shares.over(polite, 10.0)


def test_weights_divide_the_limit() -> None:
    clock = FakeClock()
    shares = FairShare({"reports": 3.0}, max_callers=100, clock=clock)
    reports, pages = shares.arrived("reports"), shares.arrived("pages")
    reports.inflight, pages.inflight = 5, 2
    assert not shares.over(reports, 8.0)  # 5 of its 6 (8 x 3/4)
    assert shares.over(pages, 8.0)  # 2 of its 2: one more would pass it
    reports.inflight = 6
    assert shares.over(reports, 8.0)
    pages.inflight = 0
    assert not shares.over(pages, 8.0)


@pytest.mark.parametrize(
    "weights,order",
    [({"reports": 3.0}, ["reports", "pages"]), ({}, ["pages", "reports"])],
    ids=["3:1", "equal"],
)
def test_weights_decide_who_is_under_its_share(weights: dict[str, float], order: list[str]) -> None:
    clock = FakeClock()
    callers = Callers(control(clock, weights=weights))
    for name in ("pages", "pages", "reports", "reports"):
        callers.admit(name)
    # Weighed 3:1, reports' share is 3 of the 4 and pages' 1: reports, at 2, is under it.
    # Equal, each has 2 of 4: both are at their share, and the line is first come.
    waiting = [callers.wait("pages"), callers.wait("reports")]
    callers.end("pages")
    callers.end("pages")
    gevent.joinall(waiting, raise_error=True)
    assert callers.order == order


def test_callers_all_over_their_share_get_the_freed_slots_by_weight() -> None:
    clock = FakeClock()
    limit = {"initial_limit": 8, "min_limit": 8, "max_limit": 8}
    callers = Callers(control(clock, weights={"heavy": 3.0}, **limit))
    # Oldest first, each call taking as long as the next: heavy at its share of 6, light at
    # its 2, so that neither is admitted past the limit.
    running = ["heavy", "heavy", "heavy", "light"] * 2
    for name in running:
        callers.admit(name)
    for _ in range(3):  # both storms keep three calls waiting: both over their share
        callers.wait("heavy")
        callers.wait("light")
    for _ in range(48):
        admitted = len(callers.order)
        callers.end(running.pop(0))
        assert len(callers.order) == admitted + 1
        running.append(callers.order[-1])
        callers.wait(callers.order[-1])
    last = callers.order[-32:]
    assert last.count("heavy") == 24 and last.count("light") == 8
    assert running.count("heavy") == 6


def test_a_storm_running_under_its_share_is_read_though_over_it_by_demand() -> None:
    """What UnreadRefusals asks: a caller back early is refused unread only while its calls
    in flight reach its share; by demand both storms are over theirs."""
    clock = FakeClock()
    admission = control(clock, weights={"heavy": 3.0}, min_limit=4, max_limit=4)
    heavy, light = admission.arrived("heavy"), admission.arrived("light")
    heavy.inflight, heavy.waiting = 2, 3
    light.inflight, light.waiting = 2, 3
    assert admission.over_share(heavy) and admission.over_share(light)  # 2 + 3 of 3; of 1
    assert admission.runs_under_share(heavy)  # 2 in flight of its 3
    assert not admission.runs_under_share(light)  # 2 in flight of its 1
    unfair = control(clock, weights={"heavy": 3.0}, min_limit=4, max_limit=4, fair_share=False)
    heavy, light = unfair.arrived("heavy"), unfair.arrived("light")
    heavy.inflight, heavy.waiting = 2, 3
    light.inflight, light.waiting = 2, 3
    assert not unfair.runs_under_share(heavy) and not unfair.over_share(light)


def test_a_caller_alone_borrows_everything_and_others_share_once_active() -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=100, clock=clock)
    storm = shares.arrived("storm")
    storm.inflight = 9
    assert not shares.over(storm, 10.0)  # alone: the whole limit is its share
    shares.arrived("polite")
    assert shares.over(storm, 10.0)  # two active: 5 each
    clock.advance(ACTIVE_S + 0.1)
    shares.arrived("storm")  # polite has been quiet for longer than ACTIVE_S: forgotten
    assert len(shares) == 1 and not shares.over(storm, 10.0)


def test_a_caller_with_calls_in_flight_stays_active() -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=100, clock=clock)
    slow = shares.arrived("slow")
    shares.admitted(slow)
    for _ in range(5):
        clock.advance(ACTIVE_S)
        shares.arrived("other")
    assert len(shares) == 2  # its call is still running
    shares.done(slow)
    clock.advance(ACTIVE_S + 0.1)
    shares.arrived("other")
    assert len(shares) == 1


def test_a_caller_with_calls_only_waiting_stays_active() -> None:
    """Its calls wait in admission's line, none runs: it is the storm still, and its
    weight still divides the limit."""
    clock = FakeClock()
    shares = FairShare({}, max_callers=100, clock=clock)
    waiting = shares.arrived("waiting")
    waiting.waiting += 1  # as admission's line counts it in
    other = shares.arrived("other")
    for _ in range(5):
        clock.advance(ACTIVE_S)
        shares.arrived("other")
    assert len(shares) == 2 and shares.runs_under(other, 10)
    assert shares.shares(10) == {"waiting": 5.0, "other": 5.0}
    waiting.waiting -= 1
    clock.advance(ACTIVE_S + 0.1)
    shares.arrived("other")
    assert len(shares) == 1


def test_at_most_max_callers_are_tracked() -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=50, clock=clock)
    for number in range(1000):
        shares.arrived(f"caller-{number}")
    assert len(shares) == 50


def test_labels_stay_bounded_and_counts_exact_with_ten_thousand_callers() -> None:
    clock = FakeClock()
    shares = FairShare({"reports": 2.0}, max_callers=1000, clock=clock, labelled=20)
    admitted = refused = 0
    for number in range(10_000):
        share = shares.arrived(f"caller-{number % 5000}")
        if number % 3:
            shares.admitted(share)
            shares.done(share)
            admitted += 1
        else:
            shares.refused(share)
            refused += 1
        clock.advance(0.001)
    assert len(shares.counts) == 1 + 20 + 1  # reports, the first twenty names seen, other
    assert "reports" in shares.counts and OTHER in shares.counts
    assert sum(c.admitted for c in shares.counts.values()) == admitted
    assert sum(c.refused for c in shares.counts.values()) == refused
    assert all(c.inflight == 0 for c in shares.counts.values())
    first = shares.counts["caller-0"]  # seen twice: 0 (refused) and 5000 (admitted)
    assert (first.admitted, first.refused) == (1, 1)


def test_a_caller_starts_and_stops_being_refused_in_one_log_line_each(caplog: Any) -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=10, clock=clock)
    storm = shares.arrived("storm")
    with caplog.at_level("INFO", logger="service.overload.fair_share"):
        for _ in range(100):
            shares.refused(storm)
        shares.admitted(storm)  # admitted soon after: still said to be refused
        clock.advance(10.0)
        shares.admitted(storm)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "caller storm: calls refused (0 in flight, weight 1)",
        "caller storm: no longer refused",
    ]


def test_callers_contend_while_one_is_over_its_share_and_another_within() -> None:
    clock = FakeClock()
    shares = FairShare({}, max_callers=10, clock=clock)
    storm = shares.arrived("storm")
    for _ in range(10):
        shares.admitted(storm)
    assert not shares.contended(10)  # over the limit, but alone: no one else to serve
    polite = shares.arrived("polite")
    assert shares.contended(10)  # the storm is over its half, polite within its own
    for _ in range(5):
        shares.admitted(polite)
    assert not shares.contended(10)  # both at their shares: they share by weight alone
    shares.done(polite)
    assert shares.contended(10)
    for _ in range(10):
        shares.done(storm)
    assert not shares.contended(10)  # both within


def test_the_gate_names_a_caller_by_certificate_then_by_meta_then_anonymous() -> None:
    clock = FakeClock()
    gate = CallGate(AdmissionSettings(), 3000, clock=clock)
    for pacing, name in [
        (ConnectionPacing(clock, identity="web.internal"), "claimed"),
        (ConnectionPacing(clock), "pages"),
        (ConnectionPacing(clock), None),
        (None, None),
    ]:
        with gate.admitted(Deadline.after_ms(1000, clock), pacing, name=name):
            pass
    counts = gate.admission.snapshot().callers
    assert {label: c.admitted for label, c in counts.items()} == {
        "web.internal": 1,
        "pages": 1,
        "anonymous": 2,
    }


def test_a_caller_refused_under_its_share_is_told_the_shortest_pause_and_not_paced() -> None:
    """Under its share a caller is admitted past the limit; the engine may still refuse it
    (no task could start): the storm is another caller's, so it is told the shortest pause
    and not paced. The storm, over its share, is told the steered pause and paced."""
    clock = FakeClock()
    settings = AdmissionSettings(
        initial_limit=2, min_limit=1, queue_interval_ms=0, queue_target_ms=0
    )
    gate = CallGate(settings, 3000, clock=clock)

    def call(pacing: ConnectionPacing, name: str) -> FanOutOverloaded:
        with pytest.raises(FanOutOverloaded) as refused:
            with gate.admitted(Deadline.after_ms(1000, clock), pacing, name=name):
                raise FanOutOverloaded("no task could start", 0)  # as the engine refuses
        return refused.value

    with ExitStack() as running:
        for _ in range(2):  # the storm takes the whole limit
            running.enter_context(
                gate.admitted(Deadline.after_ms(1000, clock), ConnectionPacing(clock), name="storm")
            )
        polite, storm = ConnectionPacing(clock), ConnectionPacing(clock)
        assert call(polite, "polite").retry_after_ms == gate.admission.least_retry_after_ms()
        assert not polite.back_early()
        assert call(storm, "storm").retry_after_ms == gate.admission.retry_after_ms()
        assert storm.back_early()
        assert gate.admission.least_retry_after_ms() < gate.admission.retry_after_ms()
    counts = gate.admission.snapshot().callers
    assert (counts["storm"].admitted, counts["storm"].refused) == (2, 1)
    assert (counts["polite"].admitted, counts["polite"].refused) == (1, 1)


def test_a_calls_tasks_wait_for_backend_slots_as_its_criticality_and_caller() -> None:
    clock = FakeClock()
    gate = CallGate(AdmissionSettings(), 3000, clock=clock)
    slots, served = OrderedSlots(1), []
    assert slots.acquire()  # the backend's one slot is busy

    def task(name: str, deadline: Deadline) -> None:  # a lookup's attempt, by its call's deadline
        assert slots.acquire(timeout=deadline.remaining_s(), flow=deadline.flow)
        served.append(name)
        slots.release()

    tasks, flows = [], []
    calls = [("storm", Criticality.CRITICAL)] * 3
    calls += [("report", Criticality.SHEDDABLE), ("page", Criticality.CRITICAL)]
    for name, criticality in calls:
        deadline = Deadline.after_ms(1000, clock)
        with gate.admitted(deadline, criticality=criticality, name=name) as call:
            flows.append(call.deadline.flow)
            assert call.deadline.at == deadline.at and deadline.flow == Flow()
            tasks.append(spawn_in_context(task, name, call.deadline.earlier(500)))
            gevent.sleep(0)  # the task joins the slots' line before the next call comes
    slots.release()
    gevent.joinall(tasks, timeout=5, raise_error=True)
    assert flows[-1] == Flow(int(Criticality.CRITICAL), "page", 1.0)
    # The page, critical, after the storm's first task only (they tie at the start); the
    # report, less critical, last.
    assert served == ["storm", "page", "storm", "storm", "report"]


class FlowSeen(Lookup):
    """A lookup that answers at once and keeps the place its call's deadline carries."""

    name = "flow_seen"
    source = "test"

    def __init__(self) -> None:
        self.seen: list[Flow] = []

    def fetch(self, window: Window, deadline: Deadline) -> AlertList:
        self.seen.append(deadline.flow)
        return AlertList(alerts=())


def test_a_lookup_run_for_a_call_waits_by_its_callers_criticality_and_weight(
    start_service: StartService,
) -> None:
    """End to end, through the real handler, gate and engine: the deadline a lookup is
    given carries its call's flow, which the backends' slots serve by."""
    lookup = FlowSeen()
    registry = LookupRegistry()
    registry.register(FlowSeen.name, lambda backends: lookup)
    service, _ = start_service(registry=registry, callers__reports__weight=3)
    asked = [("reports", "SHEDDABLE"), ("pages", None), (None, "CRITICAL_PLUS")]
    for caller, criticality in asked:
        with AppStatsClient(*service.address, timeout_ms=5000, caller=caller) as client:
            client.get_app_stats(
                "shop", SAMPLE_START_MS, SAMPLE_END_MS, [FlowSeen.name], criticality=criticality
            )
    assert lookup.seen == [
        Flow(int(Criticality.SHEDDABLE), "reports", 3.0),
        Flow(int(Criticality.CRITICAL), "pages", 1.0),
        Flow(int(Criticality.CRITICAL_PLUS), "anonymous", 1.0),  # a call naming no caller
    ]
