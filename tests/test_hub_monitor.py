"""The hub monitor: a lookup that hogs the event loop is reported as a log line and a span event."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
import types
from collections.abc import Callable
from typing import Any

import gevent
import greenlet
import pytest
from gevent.monkey import get_original

from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.panels import AlertList, Window
from lookups.registry import LookupRegistry
from service.app import FanOutService
from service.client import AppStatsClient
from service.idl import appstats
from service.operations.hub_monitor import (
    BLOCKED_EVENT,
    IDLE_PERIOD_THRESHOLDS,
    HubMonitor,
    Look,
    next_wait,
)
from service.operations.snapshot import take
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.samples import GENEROUS_BUDGETS, StartService
from tests.support.sockets import wait_for

_BUSY_S = 0.3
# The busy panel must answer OK however starved the machine: what is tested is the report.
_PATIENT = {key.replace(".", "__"): value for key, value in GENEROUS_BUDGETS.items()}
_THRESHOLD_MS = 100


def spin(seconds: float) -> None:
    """Compute without yielding: the event loop is blocked meanwhile."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


class BusyLookup(Lookup):
    """A lookup doing ~300 ms of CPU work without yielding."""

    name = "busy"
    source = "cpu"

    def fetch(self, window: Window, deadline: Deadline) -> AlertList:
        spin(_BUSY_S)
        return AlertList(alerts=())


def busy_registry() -> LookupRegistry:
    registry = LookupRegistry()
    registry.register("busy", lambda backends: BusyLookup())
    return registry


StartBusy = Callable[[int], tuple[FanOutService, AppStatsClient]]


@pytest.fixture
def start_busy(start_service: StartService) -> StartBusy:
    """A Fanout server offering only the ``busy`` panel, with the given block threshold."""
    return lambda threshold_ms: start_service(
        registry=busy_registry(), server__hub_block_threshold_ms=threshold_ms, **_PATIENT
    )


def blocked_lines(caplog: Any) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "service.operations.hub_monitor" and "blocked" in r.message
    ]


def blocked_events(spans: Any) -> list[tuple[str, Any]]:
    return [
        (span.name, event)
        for span in spans.get_finished_spans()
        for event in span.events
        if event.name == BLOCKED_EVENT
    ]


def _reported(service: Any, blocks: int) -> bool:
    return bool(service.hub_monitor.blocks_reported >= blocks)


def test_blocking_lookup_is_logged_and_recorded_on_its_span(
    start_busy: StartBusy, caplog: Any, spans: Any
) -> None:
    caplog.set_level(logging.INFO, logger="service.operations.hub_monitor")
    service, client = start_busy(_THRESHOLD_MS)
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["busy"])
    assert [o.status for o in response.outcomes] == [appstats.TaskStatus.OK]
    busy = "span 'fanout.task busy'"
    wait_for(lambda: [r for r in blocked_lines(caplog) if busy in r.message])

    # A machine whose cores other work takes may stall the loop elsewhere too: reported
    # apart, each once.
    [line] = [r for r in blocked_lines(caplog) if busy in r.message]
    assert line.levelno == logging.WARNING
    assert "span 'fanout.task busy'" in line.message
    assert "in fetch" in line.message and "spin" in line.message  # the stack while blocked
    assert service.hub_monitor.blocks_reported >= 1

    [(span_name, event)] = [
        (name, event)
        for name, event in blocked_events(spans)
        if event.attributes["span"] == "fanout.task busy"
    ]
    assert span_name in (
        "fanout.task busy",
        "AppStats/get_app_stats",
    )  # the task's, or its request's
    assert event.attributes["blocked_ms"] >= _THRESHOLD_MS
    assert event.attributes["threshold_ms"] == _THRESHOLD_MS
    assert event.attributes["span"] == "fanout.task busy"
    assert "test_hub_monitor.py" in event.attributes["location"]
    assert event.attributes["greenlet"]


def test_threshold_zero_reports_nothing(start_busy: StartBusy, caplog: Any, spans: Any) -> None:
    caplog.set_level(logging.INFO, logger="service.operations.hub_monitor")
    service, client = start_busy(0)
    response = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["busy"])
    assert [o.status for o in response.outcomes] == [appstats.TaskStatus.OK]
    gevent.sleep(0.2)  # a report, if any, would be logged by now

    assert not service.hub_monitor.running
    assert blocked_lines(caplog) == [] and blocked_events(spans) == []
    assert service.hub_monitor.blocks_reported == 0


def test_stopped_monitor_reports_nothing_and_removes_its_tracer(caplog: Any) -> None:
    tracer_before = greenlet.gettrace()
    monitor = HubMonitor(_THRESHOLD_MS).start()
    try:
        gevent.spawn(spin, _BUSY_S).join()
        wait_for(lambda: monitor.blocks_reported == 1)
        assert greenlet.gettrace() is not tracer_before
    finally:
        monitor.stop()
    assert greenlet.gettrace() is tracer_before

    gevent.spawn(spin, _BUSY_S).join()
    gevent.sleep(0.2)
    assert monitor.blocks_reported == 1
    assert len(blocked_lines(caplog)) == 1


def test_short_runs_are_not_reported() -> None:
    monitor = HubMonitor(_THRESHOLD_MS).start()
    lasted: list[float] = []

    def timed_spin() -> None:
        began = time.perf_counter()
        spin(0.01)
        lasted.append(time.perf_counter() - began)

    try:
        for _ in range(20):  # 20 runs of 10 ms: busy, but each well under the threshold
            gevent.spawn(timed_spin).join()
        gevent.sleep(0.1)
        # A run the machine preempted lasts longer on the clock, and blocks the loop that
        # long: a stressed run saw one of 115 ms, rightly reported. None shorter ever is.
        long_runs = sum(1 for seconds in lasted if seconds >= _THRESHOLD_MS / 1000.0)
        assert monitor.blocks_reported <= long_runs, lasted
    finally:
        monitor.stop()


def test_an_idle_loop_is_looked_at_less_often_than_a_busy_one() -> None:
    monitor = HubMonitor(_THRESHOLD_MS).start()
    threshold_s = _THRESHOLD_MS / 1000.0
    idle_s = threshold_s * IDLE_PERIOD_THRESHOLDS
    try:
        # Idle: the monitor backs off to once an idle period, doubling its wait at each look
        # that finds nothing ran: a few seconds asleep in the hub, or longer where greenlets
        # other tests left behind run now and then (a look after one keeps the pace).
        backed_off = False
        for _ in range(20):
            gevent.sleep(1.0)
            backed_off = monitor.waiting_s == idle_s
            if backed_off:
                break
        # Busy: greenlets run all the time, each briefly; the monitor looks at its period
        # again (as soon as a loaded machine wakes its thread).
        busy_until = time.monotonic() + 5.0
        while monitor.waiting_s == idle_s and time.monotonic() < busy_until:
            gevent.spawn(spin, 0.002).join()
        waiting_busy_s = monitor.waiting_s
    finally:
        monitor.stop()
    assert backed_off
    assert waiting_busy_s < threshold_s, waiting_busy_s


def test_a_place_that_blocks_again_is_counted_and_summed_up_not_logged_again(
    start_busy: StartBusy, caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger="service.operations.hub_monitor")
    service, client = start_busy(_THRESHOLD_MS)
    for blocks in (1, 2, 3):
        client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, ["busy"])
        wait_for(functools.partial(_reported, service, blocks))
    service.hub_monitor.flush()
    # The spin's place only: on a starved host the loop may also stall elsewhere, unasked.
    lines = [line for line in blocked_lines(caplog) if " in spin" in line.message]
    stacks = [line for line in lines if "its stack while blocked" in line.message]
    summaries = [line for line in lines if "blocked again" in line.message]
    assert len(stacks) == 1, [line.message[:120] for line in blocked_lines(caplog)]
    assert len(summaries) == 1 and " in spin x2 " in summaries[0].message, summaries
    assert take(service.parts).event_loop_blocks == service.hub_monitor.blocks_reported >= 3


def blocking_sleep(seconds: float) -> None:
    """Sleep in a system call gevent did not patch: the event loop is blocked meanwhile."""
    get_original("time", "sleep")(seconds)


def test_a_blocking_system_call_is_reported_with_the_stack_that_made_it(caplog: Any) -> None:
    """The timer signal interrupts the call, and the look runs inside it: the stack logged
    is the sleeping one, not wherever the loop went on after it."""
    caplog.set_level(logging.INFO, logger="service.operations.hub_monitor")
    monitor = HubMonitor(_THRESHOLD_MS).start()
    try:
        gevent.spawn(blocking_sleep, _BUSY_S).join()
        wait_for(lambda: any("its stack" in line.message for line in blocked_lines(caplog)))
    finally:
        monitor.stop()
    [line, *_] = [line for line in blocked_lines(caplog) if "its stack" in line.message]
    assert " at " + __file__ in line.message and "in blocking_sleep;" in line.message, line.message


def test_the_monitor_starts_no_thread() -> None:
    """Its looks are a timer signal in the loop's own thread: a thread that woke as often
    took the GIL from a busy loop each time."""
    threads = len(os.listdir("/proc/self/task"))
    monitor = HubMonitor(_THRESHOLD_MS).start()
    try:
        assert monitor.running
        assert len(os.listdir("/proc/self/task")) == threads
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    finally:
        monitor.stop()
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_a_sigalrm_handled_by_something_else_is_left_alone(caplog: Any) -> None:
    def theirs(signum: int, frame: Any) -> None:
        raise AssertionError("not expected to fire")

    caplog.set_level(logging.INFO, logger="service.operations.hub_monitor")
    before = signal.signal(signal.SIGALRM, theirs)
    try:
        monitor = HubMonitor(_THRESHOLD_MS).start()
        assert not monitor.running
        assert signal.getsignal(signal.SIGALRM) is theirs
        assert any("SIGALRM is handled by something else" in r.message for r in caplog.records)
    finally:
        signal.signal(signal.SIGALRM, before)


def test_a_look_in_the_hub_tells_an_idle_loop_from_one_resting_between_runs() -> None:
    """Found in the hub: idle if the loop has not left it since the last look (nothing can
    block there, so the looks back off furthest), resting if it ran something since."""
    from service.operations.hub_monitor import _Watch

    hub = object()
    tracer = types.SimpleNamespace(last_entered_hub=5.0, active_greenlet=hub)
    watch = _Watch(tracer=tracer, hub=hub, key=0, threshold_s=0.1, period_s=0.025)
    monitor = HubMonitor(_THRESHOLD_MS)
    assert monitor._check(watch, None) is Look.RESTING  # it entered the hub since
    assert monitor._check(watch, None) is Look.IDLE  # and has stayed there
    tracer.last_entered_hub = 6.0  # ran a greenlet, back in the hub
    assert monitor._check(watch, None) is Look.RESTING
    assert monitor._check(watch, None) is Look.IDLE


def test_the_looks_follow_what_they_find() -> None:
    """Busy: every quarter threshold; resting between runs: doubling up to one threshold
    (a longer wait from idle kept); idle: doubling up to the idle period."""
    period, threshold = 0.025, 0.1
    idle = threshold * IDLE_PERIOD_THRESHOLDS
    assert next_wait(Look.BUSY, idle, period, threshold) == period
    assert next_wait(Look.RESTING, period, period, threshold) == 2 * period
    assert next_wait(Look.RESTING, 0.08, period, threshold) == threshold
    assert next_wait(Look.RESTING, idle, period, threshold) == idle
    assert next_wait(Look.IDLE, threshold, period, threshold) == 2 * threshold
    assert next_wait(Look.IDLE, idle, period, threshold) == idle
