"""Brownout: criticality, optional panels, the dimmer's ladder and controller, end to end."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import gevent
import gevent.event
import pytest
import requests

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.cli.pools import format_pools
from service.client import AppStatsClient
from service.engine.settings import AdmissionSettings
from service.idl import appstats
from service.overload.admission import AdmissionControl, Refused
from service.overload.brownout import (
    AVOID_S,
    BACKOFF_MAX,
    COOL_WINDOWS,
    PROBATION_WINDOWS,
    STEP,
    WINDOW_S,
    BrownoutVerdict,
    Criticality,
    Dimmer,
)
from service.overload.ticket import CallTicket
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData, SampleHttpServices
from service.testing import FakeClock
from tests.support.sockets import wait_for

OPTIONAL = {"controllers", "queries", "volume"}
ESSENTIAL = {"errors", "urls", "alerts", "latency"}
C = Criticality

#: The ticket of a call of no caller: all that ``done`` reads of it.
ANY_CALL = CallTicket(Deadline.after_s(3600))


def shares(dimmer: Dimmer, criticality: Criticality, calls: int = 100) -> Counter[BrownoutVerdict]:
    return Counter(dimmer.decide(criticality) for _ in range(calls))


# --- the ladder ------------------------------------------------------------------------------


def test_nothing_is_shed_at_level_zero() -> None:
    dimmer = Dimmer(lambda: 0, lambda: False)
    for criticality in Criticality:
        assert shares(dimmer, criticality) == Counter({BrownoutVerdict.WHOLE: 100})


def test_the_ladder_sheds_in_the_order_the_issue_gives() -> None:
    dimmer = Dimmer(lambda: 0, lambda: False)
    seen = []
    for step in range(int(1 / STEP) + 1):
        dimmer.level = round(step * STEP, 6)
        got = {c: shares(dimmer, c) for c in Criticality}
        whole = {c: got[c][BrownoutVerdict.WHOLE] for c in Criticality}
        lighter = {c: got[c][BrownoutVerdict.LIGHTER] for c in Criticality}
        refused = {c: got[c][BrownoutVerdict.REFUSED] for c in Criticality}
        # The dimmer never refuses a CRITICAL or CRITICAL_PLUS call: admission does, last.
        assert refused[C.CRITICAL] == refused[C.CRITICAL_PLUS] == 0
        # While any SHEDDABLE call keeps its optional panels, nothing else is shed.
        if whole[C.SHEDDABLE]:
            assert sum(refused.values()) == 0
            assert lighter[C.CRITICAL] == lighter[C.SHEDDABLE_PLUS] == lighter[C.CRITICAL_PLUS] == 0
        # A SHEDDABLE call is refused only once none of them runs its optional panels.
        if refused[C.SHEDDABLE]:
            assert whole[C.SHEDDABLE] == 0
        # CRITICAL calls lose optional panels only once every SHEDDABLE call is refused.
        if lighter[C.CRITICAL]:
            assert refused[C.SHEDDABLE] == 100
        # SHEDDABLE_PLUS is refused only once CRITICAL calls are all lighter.
        if refused[C.SHEDDABLE_PLUS]:
            assert lighter[C.CRITICAL] == 100
        # CRITICAL_PLUS calls are lightened last, once SHEDDABLE_PLUS is all refused.
        if lighter[C.CRITICAL_PLUS]:
            assert refused[C.SHEDDABLE_PLUS] == 100
        seen.append(
            (
                dimmer.level,
                whole[C.SHEDDABLE],
                refused[C.SHEDDABLE],
                lighter[C.CRITICAL],
                refused[C.SHEDDABLE_PLUS],
                lighter[C.CRITICAL_PLUS],
            )
        )
    # Within a rung the share grows with the level, evenly: a quarter of a rung, a quarter shed.
    assert (0.05, 75, 0, 0, 0, 0) in seen and (0.3, 0, 50, 0, 0, 0) in seen
    assert (0.5, 0, 100, 50, 0, 0) in seen and (0.7, 0, 100, 100, 50, 0) in seen
    assert seen[-1] == (1.0, 0, 100, 100, 100, 100)


def test_the_dimmer_counts_each_call_it_sheds_by_criticality() -> None:
    dimmer = Dimmer(lambda: 0, lambda: False)
    dimmer.level = 0.3
    shares(dimmer, C.SHEDDABLE, 10)
    shares(dimmer, C.CRITICAL, 10)
    assert dimmer.stats.refused == {"SHEDDABLE": 5}
    assert dimmer.stats.lighter == {"SHEDDABLE": 5}


# --- the controller, with an injected clock --------------------------------------------------


class Signals:
    def __init__(self) -> None:
        self.refusals = 0
        self.standing = False
        self.cuts = 0
        self.clock = FakeClock(0.0)
        self.spare = False  # admission had room to spare this window
        self.pools_short = False


def controller(min_level: float = 0.0) -> tuple[Dimmer, Signals]:
    signals = Signals()
    dimmer = Dimmer(
        lambda: signals.refusals,
        lambda: signals.standing,
        min_level=min_level,
        latency_cuts=lambda: signals.cuts,
        pools_short=lambda: signals.pools_short,
        spare=lambda: signals.spare,
        clock=signals.clock,
    )
    return dimmer, signals


def window(
    dimmer: Dimmer,
    signals: Signals,
    refusals: int = 0,
    standing: bool = False,
    arrived: tuple[Criticality, ...] = tuple(Criticality),
    cuts: int = 0,
) -> float:
    """One window of the controller: ``refusals`` and rounds of latency ``cuts`` by
    admission, calls of ``arrived``."""
    for criticality in arrived:
        dimmer.arrivals[criticality] += 1
    signals.clock.advance(0.25)
    signals.refusals += refusals
    signals.cuts += cuts
    signals.standing = standing
    dimmer.update()
    return dimmer.level


def test_the_controller_climbs_a_step_per_window_with_refusals(caplog) -> None:
    dimmer, signals = controller()
    with caplog.at_level(logging.INFO, logger="service.overload.brownout"):
        levels = [window(dimmer, signals, refusals=3) for _ in range(5)]
    assert levels == [0.05, 0.1, 0.15, 0.2, 0.25]
    lines = [r for r in caplog.records if "brownout level" in r.getMessage()]
    assert len(lines) == 5 and all(r.levelno == logging.INFO for r in lines)
    for _ in range(30):
        window(dimmer, signals, refusals=1)
    assert dimmer.level == 1.0  # and no further


def test_the_controller_holds_on_a_standing_queue_and_comes_down_only_after_a_cool_stretch() -> (
    None
):
    dimmer, signals = controller()
    for _ in range(6):
        window(dimmer, signals, refusals=1)
    assert dimmer.level == 0.3
    # Queueing is no overload by itself: the level holds, neither up nor down.
    assert [window(dimmer, signals, standing=True) for _ in range(10)] == [0.3] * 10
    # Cool windows: down one step after COOL_WINDOWS in a row, not before.
    cool = [window(dimmer, signals) for _ in range(2 * COOL_WINDOWS)]
    assert cool == [0.3] * (COOL_WINDOWS - 1) + [0.25] * COOL_WINDOWS + [0.2]
    # A refusal in the middle of a cool stretch starts it again (and takes a step up); it
    # came right after a step down, so the next cool stretch is twice as long, and 0.2 is
    # not stepped down to again until AVOID_S has passed.
    window(dimmer, signals)
    window(dimmer, signals, refusals=1)
    cool = [window(dimmer, signals) for _ in range(wait_after(1))]
    assert cool == [0.25] * (wait_after(1) - 1) + [0.2]


def test_the_dimmer_lets_go_at_once_when_admission_has_room_to_spare(caplog) -> None:
    """The storm ended: a window in which nothing waited and half the limit or less was in
    flight takes the level to its floor, not a step per cool stretch."""
    dimmer, signals = controller(min_level=0.1)
    for _ in range(12):
        window(dimmer, signals, refusals=1)
    assert dimmer.level == 0.7
    signals.spare = True
    with caplog.at_level(logging.INFO, logger="service.overload.brownout"):
        assert window(dimmer, signals) == 0.1
    assert any("(the load is gone)" in r.getMessage() for r in caplog.records)
    assert window(dimmer, signals, refusals=1) == 0.15  # a refusal: up again, as ever


def test_room_to_spare_does_not_let_go_while_refusing_cutting_or_short_of_slots() -> None:
    dimmer, signals = controller()
    for _ in range(12):
        window(dimmer, signals, refusals=1)
    signals.spare = True
    assert window(dimmer, signals, refusals=1) == 0.65  # refused: up, as ever
    assert window(dimmer, signals, cuts=1) == 0.65  # latency cut: holds
    signals.pools_short = True  # the optional panels would take slots essential ones wait for
    assert window(dimmer, signals) >= 0.65
    signals.pools_short = False
    assert window(dimmer, signals) == 0.0


def wait_after(failures: int) -> int:
    """Windows before the next step down after ``failures`` steps down in a row that
    brought refusals back: the doubled cool stretches that outlast the avoided time."""
    if failures == 0:
        return COOL_WINDOWS
    doublings = min(failures, BACKOFF_MAX)
    cool, avoid = COOL_WINDOWS << doublings, (AVOID_S << (doublings - 1)) / WINDOW_S
    return int(-(-avoid // cool) * cool)


def test_a_step_down_that_brings_refusals_back_is_avoided_longer_each_time() -> None:
    dimmer, signals = controller()
    for _ in range(6):
        window(dimmer, signals, refusals=1)
    waits = []
    for _ in range(BACKOFF_MAX + 2):  # overload that stays: every step down is refused
        waits.append(next(n for n in range(1, 1000) if window(dimmer, signals) < 0.3))
        assert window(dimmer, signals, refusals=1) == 0.3
    assert waits == [wait_after(n) for n in range(BACKOFF_MAX + 2)] == [8, 64, 128, 256, 256]
    # The load falls: the next step down holds through its probation, and from then on the
    # level comes down at its pace.
    longest = wait_after(BACKOFF_MAX + 2)
    levels = [
        window(dimmer, signals) for _ in range(longest + PROBATION_WINDOWS + 2 * COOL_WINDOWS)
    ]
    assert levels == [0.3] * (longest - 1) + [0.25] * PROBATION_WINDOWS + [0.2] * COOL_WINDOWS + [
        0.15
    ] * COOL_WINDOWS + [0.1]


def test_latency_rising_after_a_step_down_takes_it_back_before_any_refusal() -> None:
    """Where the bound is a pool, refusals come seconds after the step down that caused
    them; admission cutting its limit on latency comes first, and the dimmer heeds it."""
    dimmer, signals = controller()
    for _ in range(6):
        window(dimmer, signals, refusals=1)
    # Outside a step down's probation a cut holds the level, as a standing queue does: the
    # cool stretch starts again, and the level never climbs on a cut alone.
    levels = [window(dimmer, signals, cuts=int(i == 4)) for i in range(COOL_WINDOWS + 5)]
    assert levels == [0.3] * (COOL_WINDOWS + 4) + [0.25]
    # Within it, a cut fails the step as a refusal would: back up, 0.25 avoided, the cool
    # stretch doubled.
    assert window(dimmer, signals, cuts=1) == 0.3
    cool = [window(dimmer, signals) for _ in range(wait_after(1))]
    assert cool == [0.3] * (wait_after(1) - 1) + [0.25]
    assert signals.refusals == 6  # none since the climb


def test_the_level_climbs_no_higher_than_the_calls_that_arrive_can_be_shed() -> None:
    dimmer, signals = controller()
    only_critical = (C.CRITICAL,)
    levels = [window(dimmer, signals, refusals=1, arrived=only_critical) for _ in range(20)]
    assert max(levels) == 0.6  # CRITICAL's rung (their optional panels) is whole there
    levels = [window(dimmer, signals, refusals=1, arrived=(C.SHEDDABLE,)) for _ in range(12)]
    assert levels[:7] == [0.6] * 7 and levels[-1] == 0.4  # CRITICAL remembered for 2 s
    levels = [window(dimmer, signals, refusals=1, arrived=(C.CRITICAL_PLUS,)) for _ in range(20)]
    assert levels[-1] == 1.0


def test_a_pool_short_of_slots_climbs_a_level_that_is_up_and_holds_it_but_starts_none() -> None:
    signals, short = Signals(), {"now": True}
    dimmer = Dimmer(
        lambda: signals.refusals,
        lambda: signals.standing,
        pools_short=lambda: short["now"],
        clock=signals.clock,
    )
    only_critical = (C.CRITICAL,)
    # Full pools alone shed nothing: a load admission carries without refusing is served whole.
    assert {window(dimmer, signals, arrived=only_critical) for _ in range(4 * COOL_WINDOWS)} == {
        0.0
    }
    window(dimmer, signals, refusals=1, arrived=only_critical)
    # Once up, a step a window up to the most the calls that arrive can be shed...
    levels = [window(dimmer, signals, arrived=only_critical) for _ in range(12)]
    assert levels == [round(0.1 + STEP * i, 6) for i in range(11)] + [0.6]
    # ...and held there past any cool stretch, while the pools stay short.
    assert {window(dimmer, signals, arrived=only_critical) for _ in range(4 * COOL_WINDOWS)} == {
        0.6
    }
    short["now"] = False  # room again: down at the cool pace
    levels = [window(dimmer, signals, arrived=only_critical) for _ in range(COOL_WINDOWS)]
    assert levels[-1] == 0.55 and set(levels) <= {0.6, 0.55}


@pytest.mark.solo
def test_a_server_whose_backend_pool_is_short_of_slots_sheds_once_the_dimmer_is_up(
    start_service, slow_alerts: SampleHttpServices, caplog
) -> None:
    """Four callers on HTTP pools of one slot (alerts take 150 ms): admission refuses none,
    the alerts pool is short of slots, and from its least level the dimmer climbs on that.
    The callers ask for the alerts panel alone: with every panel, a machine starved of CPU
    spent so long on the others that the four seldom met at the pool, which was then
    rightly not short."""
    service, _ = start_service(
        http=slow_alerts, http__pool_maxsize=1, admission__brownout_min_level=STEP
    )
    stop = gevent.event.Event()

    def caller() -> None:
        with AppStatsClient(*service.address, timeout_ms=10_000) as client:
            while not stop.is_set():
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["alerts"])

    with caplog.at_level(logging.INFO, logger="service.overload.brownout"):
        callers = [gevent.spawn(caller) for _ in range(4)]
        try:
            wait_for(lambda: service.gate.dimmer.level >= 0.4, 20, "the dimmer climbing")
        finally:
            stop.set()
            gevent.joinall(callers, timeout=15, raise_error=True)
    assert service.gate.admission.refusals_decided == 0
    assert any("a backend pool is short of slots" in r.getMessage() for r in caplog.records)
    # fanout pools says the pool was short even with the dimmer up.
    assert re.search(
        r"^brownout level=\S+ peak=\S+ over 60 s: .*\(the dimmer was up, and "
        r"([\w.]+, )*alerts(, [\w.]+)* short of slots even so\)$",
        format_pools(service.handler.pool_stats()),
        re.M,
    )


def run_plant(edge: float, queue_band: float, windows: int = 240) -> list[float]:
    """A steady load the server can carry once ``edge`` of it is shed: admission refuses
    below that level, and its queue stands within ``queue_band`` above it."""
    dimmer, signals = controller()
    levels = []
    for _ in range(windows):
        level = dimmer.level
        levels.append(
            window(dimmer, signals, refusals=int(level < edge), standing=level < edge + queue_band)
        )
    return levels


def test_at_a_steady_load_the_level_settles_and_does_not_flap() -> None:
    levels = run_plant(edge=0.3, queue_band=0.1)
    assert levels[5] == 0.3 and set(levels[6:]) == {0.3}  # up at once, then held by the queue
    # With no queue to hold it, the level can only dither by one step around the edge.
    levels = run_plant(edge=0.3, queue_band=0.0)
    assert min(levels[10:]) == 0.25 and max(levels[10:]) == 0.3


def test_min_level_holds_the_dimmer_up_and_a_disabled_dimmer_never_moves() -> None:
    dimmer, signals = controller(min_level=0.2)
    assert dimmer.level == 0.2
    for _ in range(20):
        window(dimmer, signals)
    assert dimmer.level == 0.2
    off_signals = Signals()
    off = Dimmer(lambda: off_signals.refusals, lambda: False, enabled=False, min_level=0.5)
    off_signals.refusals = 10
    off.update()
    assert off.level == 0.0 and shares(off, C.SHEDDABLE)[BrownoutVerdict.WHOLE] == 100


# --- admission's line: the more critical first -----------------------------------------------


def one_call_admission(clock: Clock = SYSTEM_CLOCK) -> AdmissionControl:
    settings = AdmissionSettings(
        initial_limit=1, min_limit=1, max_limit=1, queue_interval_ms=2000, queue_target_ms=2000
    )
    admission = AdmissionControl(settings, 10_000, clock=clock)
    admission.admit(CallTicket(Deadline.after_s(10, clock)))  # the one call in flight
    return admission


def waiting(admission: AdmissionControl, criticality: Criticality, order: list[str]) -> Any:
    def wait() -> None:
        try:
            admission.admit(CallTicket(Deadline.after_s(10), criticality))
        except Refused:
            order.append(f"refused {criticality.name}")
            return
        order.append(f"admitted {criticality.name}")

    waiter = gevent.spawn(wait)
    gevent.sleep(0.01)
    return waiter


def test_the_dimmer_at_rest_sleeps_until_admission_refuses_then_climbs() -> None:
    """On the service's clock: the dimmer's windows pass only as the test moves it."""
    clock = FakeClock()
    admission = one_call_admission(clock)
    looks = [0]

    def refusals() -> int:
        looks[0] += 1
        return admission.refusals_decided

    dimmer = Dimmer(
        refusals,
        lambda: admission.queue_standing,
        latency_cuts=lambda: admission.stats.latency_cuts,
        pressure=admission.pressure,
        clock=clock,
    )
    dimmer.start()
    try:
        gevent.sleep(0.05)
        assert looks[0] == 3  # at start, and twice before it slept...
        for _ in range(6):
            clock.advance(WINDOW_S)
        assert looks[0] == 3  # ...and not once a window since
        with pytest.raises(Refused):
            admission.admit(CallTicket(Deadline.after_s(-1.0, clock)))  # no time left, saturated
        for criticality in Criticality:  # calls the dimmer could shed arrived (the gate counts)
            dimmer.arrivals[criticality] += 1
        gevent.sleep(0)  # the refusal woke it: it sleeps a window of the clock
        assert dimmer.level == 0.0
        clock.advance(WINDOW_S)
        assert dimmer.level == STEP
    finally:
        dimmer.stop()
    assert dimmer.level == STEP


def test_a_critical_newcomer_takes_a_sheddable_waiters_place_and_is_served_first() -> None:
    admission, order = one_call_admission(), list[Any]()
    waiting(admission, C.SHEDDABLE, order)  # the line holds one: it is full now
    waiting(admission, C.CRITICAL, order)  # takes its place
    assert order == ["refused SHEDDABLE"]
    waiting(admission, C.SHEDDABLE_PLUS, order)  # less critical than the line: refused
    assert order == ["refused SHEDDABLE", "refused SHEDDABLE_PLUS"]
    admission.done(ANY_CALL, 0.01)
    gevent.sleep(0.01)
    assert order[-1] == "admitted CRITICAL"
    assert admission.stats.refused_queue == 2


def test_the_line_serves_the_more_critical_first_whatever_the_order_they_came_in() -> None:
    settings = AdmissionSettings(
        initial_limit=3, min_limit=3, max_limit=3, queue_interval_ms=2000, queue_target_ms=2000
    )
    admission = AdmissionControl(settings, 10_000)
    for _ in range(3):
        admission.admit(CallTicket(Deadline.after_s(10)))
    order: list[str] = []
    for criticality in (C.SHEDDABLE, C.CRITICAL, C.CRITICAL_PLUS):
        waiting(admission, criticality, order)
    for _ in range(3):
        admission.done(ANY_CALL, 0.01)
        gevent.sleep(0.01)
    assert order == ["admitted CRITICAL_PLUS", "admitted CRITICAL", "admitted SHEDDABLE"]


# --- a whole server --------------------------------------------------------------------------


def outcomes(response: Any) -> dict[str, tuple[int, Any]]:
    return {o.name: (o.status, o.error_type) for o in response.outcomes}


def test_a_shed_panel_runs_no_lookup_takes_no_slot_and_says_why(start_service, spans) -> None:
    service, client = start_service(admission__brownout_min_level=0.2)
    attempts = {b.name: b.guard.attempts for b in service.backends}
    started = service.fanout.stats.started
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, criticality="SHEDDABLE")
    got = outcomes(response)
    assert {
        name for name, (status, _) in got.items() if status == appstats.TaskStatus.OK
    } == ESSENTIAL
    assert {
        name
        for name, (status, error) in got.items()
        if status == appstats.TaskStatus.SKIPPED and error == "Brownout"
    } == OPTIONAL
    assert all(o.retryable for o in response.outcomes if o.name in OPTIONAL)
    assert set(response.panels) == ESSENTIAL
    # No slot, no backend call: four tasks ran, the Mongo backend was called for errors and
    # urls only, the metrics service for latency only.
    assert service.fanout.stats.started - started == 4
    after = {b.name: b.guard.attempts for b in service.backends}
    assert after["mongo"] - attempts["mongo"] == 2 and after["metrics"] - attempts["metrics"] == 1
    assert service.parts.skipped["brownout"] == 3
    finished = spans.get_finished_spans()
    request = next(s for s in finished if s.name == "AppStats/get_app_stats")
    assert request.attributes["fanout.criticality"] == "SHEDDABLE"
    skipped = {
        s.attributes["fanout.task.name"]: s.attributes.get("fanout.task.skip_reason")
        for s in finished
        if s.name.startswith("fanout.task ") and s.attributes.get("fanout.task.status") == "SKIPPED"
    }
    assert skipped == {name: "brownout" for name in OPTIONAL}
    # A call that says nothing is CRITICAL, and at this level it is served whole.
    plain = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
    assert all(status == appstats.TaskStatus.OK for status, _ in outcomes(plain).values())


def test_panel_info_tells_the_optional_panels(start_service) -> None:
    _, client = start_service(lookups__urls__optional=True, lookups__volume__optional=False)
    info = {p.name: (p.is_optional, p.is_required) for p in client.panel_info()}
    assert info == {
        "errors": (False, False),
        "urls": (True, False),
        "controllers": (True, False),
        "queries": (True, False),
        "alerts": (False, False),
        "latency": (False, False),
        "volume": (False, False),
    }


def test_an_unknown_criticality_is_a_typed_error_naming_the_field(start_service) -> None:
    _, client = start_service()
    request = appstats.StatsRequest(
        app="shop",
        start_ms=SAMPLE_START_MS,
        end_ms=SAMPLE_END_MS,
        meta=appstats.RequestMeta(criticality=7),
    )
    with pytest.raises(appstats.InvalidRequest) as raised:
        client._call("get_app_stats", 5000, lambda remaining_ms: (request,))
    assert raised.value.field == "meta.criticality"
    with pytest.raises(ValueError, match="criticality"):
        client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, criticality="URGENT")


@pytest.fixture
def slow_alerts(sample_data: SampleData) -> Iterator[SampleHttpServices]:
    with SampleHttpServices(sample_data, alerts_delay_ms=150) as services:
        yield services


@pytest.mark.solo
def test_a_critical_plus_call_is_served_while_sheddable_calls_are_refused(
    start_service, slow_alerts: SampleHttpServices
) -> None:
    """Admission lets two calls in at a time; SHEDDABLE callers that never back off make it
    refuse, the dimmer climbs until they are refused before admission, and a CRITICAL_PLUS
    call is then served whole."""
    service, _ = start_service(
        http=slow_alerts,
        admission__initial_limit=2,
        admission__min_limit=2,
        admission__max_limit=2,
        admission__queue_interval_ms=1000,
        admission__queue_target_ms=1000,
    )
    refused, served = Counter[str](), Counter[str]()
    stop = gevent.event.Event()

    def sheddable_caller() -> None:
        with AppStatsClient(*service.address, overload_retry_ratio=0.0) as client:
            while not stop.is_set():
                try:
                    client.get_app_stats(
                        "shop", SAMPLE_START_MS, SAMPLE_END_MS, criticality="SHEDDABLE"
                    )
                    served["SHEDDABLE"] += 1
                except appstats.Overloaded:
                    refused["SHEDDABLE"] += 1
                    gevent.sleep(0.02)

    callers = [gevent.spawn(sheddable_caller) for _ in range(12)]
    try:
        wait_for(
            lambda: service.gate.dimmer.level >= 0.4, 20, "the dimmer refusing SHEDDABLE calls"
        )
        before = service.gate.dimmer.stats.refused.get("SHEDDABLE", 0)
        with AppStatsClient(*service.address, overload_retry_ratio=0.0) as client:
            response = client.get_app_stats(
                "shop",
                SAMPLE_START_MS,
                SAMPLE_END_MS,
                criticality="CRITICAL_PLUS",
                deadline_ms=5000,
            )
        assert all(status == appstats.TaskStatus.OK for status, _ in outcomes(response).values())
        assert service.gate.dimmer.stats.refused.get("SHEDDABLE", 0) > before
    finally:
        stop.set()
        gevent.joinall(callers, timeout=10)
    assert service.gate.stats.refused["CRITICAL_PLUS"] == 0
    assert refused["SHEDDABLE"] > 0


@pytest.mark.solo
def test_metrics_count_each_skipped_panel_and_refusal_once_as_callers_got_them(
    serve: Any, http_services: Any
) -> None:
    """At level 0.5: every SHEDDABLE call refused, half of the SHEDDABLE_PLUS and CRITICAL
    calls lighter, CRITICAL_PLUS whole. The scrape says what the callers received."""
    server = serve(
        http_services,
        **{
            "metrics.exporter": "prometheus",
            "metrics.port": 0,
            "admission.brownout_min_level": 0.5,
        },
    )
    received_skips, received_refusals = 0, Counter[str]()
    with AppStatsClient("127.0.0.1", server.port, overload_retry_ratio=0.0) as client:
        for criticality in ["SHEDDABLE", "SHEDDABLE_PLUS", "CRITICAL", None, "CRITICAL_PLUS"] * 4:
            try:
                response = client.get_app_stats(
                    "shop", SAMPLE_START_MS, SAMPLE_END_MS, criticality=criticality
                )
            except appstats.Overloaded:
                received_refusals[criticality or "CRITICAL"] += 1
                continue
            received_skips += sum(o.error_type == "Brownout" for o in response.outcomes)
    assert received_refusals == {"SHEDDABLE": 4}
    assert received_skips == 3 * (2 + 4)  # half of 4 SHEDDABLE_PLUS, half of 8 CRITICAL
    found = wait_for(
        lambda: re.search(r"Prometheus scrape at (http://\S+/metrics)", server.log()),
        10,
        "the scrape address in the log",
    )
    text = requests.get(found.group(1), timeout=5).text
    assert re.search(
        rf'^fanout_panels_skipped_total\{{.*fanout_skip_reason="brownout".*\}} '
        rf"{received_skips}\.0$",
        text,
        re.M,
    ), text
    assert re.search(
        r'^fanout_panels_skipped_total\{.*fanout_skip_reason="disabled".*\} 0\.0$', text, re.M
    )
    for criticality in ("SHEDDABLE", "SHEDDABLE_PLUS", "CRITICAL", "CRITICAL_PLUS"):
        assert re.search(
            rf'^fanout_calls_refused_total\{{.*fanout_criticality="{criticality}".*\}} '
            rf"{received_refusals[criticality]}\.0$",
            text,
            re.M,
        ), text
    assert re.search(r"^fanout_brownout_level(_ratio)?(\{[^}]*\})? 0\.5$", text, re.M), text
    # The command line: a SHEDDABLE call is refused, panel_info tells the optional panels,
    # and fanout pools says the dimmer was the bound.
    port = ["--port", str(server.port)]
    refused = fanout(
        "call",
        "get_app_stats",
        *port,
        "--app",
        "shop",
        "--criticality",
        "SHEDDABLE",
        "--start-ms",
        str(SAMPLE_START_MS),
        "--end-ms",
        str(SAMPLE_END_MS),
    )
    assert refused.returncode == 1 and "shed under load (brownout)" in refused.stderr
    info = fanout("call", "panel_info", *port)
    assert info.returncode == 0 and "volume (http): optional" in info.stdout
    assert "errors (mongo): essential" in info.stdout, info.stdout
    pools = fanout("pools", *port)
    assert re.search(
        r"^brownout level=0\.50 peak=0\.50 over 60 s: \d+ calls answered lighter, "
        r"[1-9]\d* refused",
        pools.stdout,
        re.M,
    ), pools.stdout


def fanout(*args: str) -> Any:
    import subprocess

    from tests.support.processes import FANOUT

    return subprocess.run([*FANOUT, *args], capture_output=True, text=True, timeout=60)


def sheddable_request() -> Any:
    """A SHEDDABLE call for the whole sample window, due in a second: at level 0.4 and up
    the dimmer refuses every one."""
    return appstats.StatsRequest(
        app="shop",
        start_ms=SAMPLE_START_MS,
        end_ms=SAMPLE_END_MS,
        meta=appstats.RequestMeta(deadline_ms=1000, criticality=C.SHEDDABLE),
    )


@pytest.mark.solo
def test_a_sheddable_caller_back_too_early_is_refused_unread_while_the_dimmer_refuses_them(
    start_service,
) -> None:
    """At 0.4 every SHEDDABLE call is refused; a plain caller that asks again at once has
    its next call refused from the header, never decoded, and each refusal counted once."""
    import socket

    from tests.support.pacing import plain_client

    service, _ = start_service(admission__brownout_min_level=0.4)
    request = sheddable_request()
    messages = []
    with socket.create_connection(service.address, timeout=5) as sock:
        client = plain_client(sock)
        for _ in range(3):
            with pytest.raises(appstats.Overloaded) as refused:
                client.get_app_stats(request)
            messages.append(refused.value.message)
    assert "brownout" in messages[0]
    assert all("without being read" in message for message in messages[1:]), messages
    assert service.gate.admission.stats.refused_unread == 2
    assert service.gate.stats.refused["SHEDDABLE"] == 3
    assert not service.gate.admission.saturated


def test_a_sheddable_caller_the_dimmer_refuses_is_told_a_growing_pause(start_service) -> None:
    """Calls shed by the dimmer steer ``retry_after_ms`` as admission's refusals do: a
    caller that comes back after half its pause, refused each time, is told a longer one
    once a second of them has passed (uncounted, the pause fell to its floor, and callers
    that ignore it were no longer held)."""
    import socket
    import time

    from tests.support.pacing import plain_client

    service, _ = start_service(admission__brownout_min_level=0.4)
    request = sheddable_request()
    told: list[Any] = []
    with socket.create_connection(service.address, timeout=5) as sock:
        client = plain_client(sock)
        started = time.monotonic()
        while time.monotonic() - started < 2.5 and not (told and told[-1] > told[0]):
            with pytest.raises(appstats.Overloaded) as refused:
                client.get_app_stats(request)
            assert "brownout" in refused.value.message  # shed, never held nor unread
            told.append(refused.value.retry_after_ms)
            time.sleep(told[-1] / 2000.0)
    assert max(told) > told[0], told
    assert service.gate.admission.stats.refused == 0


@pytest.mark.solo
def test_after_a_storm_ends_a_lone_call_is_answered_whole(start_service: Any, caplog: Any) -> None:
    """Callers storm a server whose limit is four calls: admission refuses, the dimmer climbs.
    Once they stop, a lone call every tenth of a second finds the dimmer let go at once,
    not a step per cool stretch."""
    caplog.set_level(logging.INFO, logger="service.overload.brownout")
    service, _ = start_service(
        admission__initial_limit=4, admission__min_limit=4, admission__max_limit=4
    )
    stop = gevent.event.Event()

    def storm() -> None:
        with AppStatsClient(*service.address, overload_retry_ratio=0.0) as client:
            while not stop.is_set():
                try:
                    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                except appstats.Overloaded:
                    gevent.sleep(0.01)

    callers = [gevent.spawn(storm) for _ in range(24)]
    try:
        # At 0.6 every CRITICAL call is answered lighter.
        wait_for(lambda: service.gate.dimmer.level >= 0.6, 30, "the dimmer climbing")
    finally:
        stop.set()
        gevent.joinall(callers, timeout=10)
    whole: list[bool] = []
    with AppStatsClient(*service.address, overload_retry_ratio=0.0) as client:

        def lone_call_whole() -> bool:
            gevent.sleep(0.1)
            response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
            whole.append(all(o.status == appstats.TaskStatus.OK for o in response.outcomes))
            return whole[-1]

        wait_for(lone_call_whole, 30, "a lone call answered whole")
    assert service.gate.dimmer.level == 0.0 and whole[-1]
    assert any("(the load is gone)" in r.getMessage() for r in caplog.records)
