"""Pool advice an operator can trust: a true rolling window, never below what is in use,
and a pool starved of CPU is not told to grow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import gevent
import pytest
from gevent.lock import BoundedSemaphore

from lookups.clock import SYSTEM_CLOCK
from tracing.pools import MeteredSlots, PoolMeter


def hold_slots(slots: MeteredSlots, takers: int, hold_s: float, timeout_s: float) -> list[bool]:
    """``takers`` greenlets at once, each holding a slot for ``hold_s`` if it gets one in time."""

    def take() -> bool:
        if not slots.acquire(timeout=timeout_s):
            return False
        gevent.sleep(hold_s)
        slots.release()
        return True

    return [g.get() for g in [gevent.spawn(take) for _ in range(takers)]]


def test_a_pool_saturated_by_a_burst_after_a_quiet_spell_is_recommended_bigger() -> None:
    # Holds alone would understate the need: two slots busy for half the window.
    slots = MeteredSlots(BoundedSemaphore(2), PoolMeter("burst", 2, clock=SYSTEM_CLOCK))
    gevent.sleep(0.3)
    assert all(hold_slots(slots, takers=8, hold_s=0.05, timeout_s=5))
    report = slots.meter.report()
    assert report.wait_p99_ms > 0 and report.timeouts == 0
    assert report.recommended > report.size, report


def test_takers_that_waited_in_vain_count_towards_the_recommendation() -> None:
    slots = MeteredSlots(BoundedSemaphore(1), PoolMeter("vain", 1, clock=SYSTEM_CLOCK))
    got = hold_slots(slots, takers=4, hold_s=0.2, timeout_s=0.05)
    report = slots.meter.report()
    assert got.count(True) == 1 and report.timeouts == 3
    assert report.recommended >= 2, report


def test_a_pool_that_never_waits_is_recommended_about_what_it_uses() -> None:
    slots = MeteredSlots(BoundedSemaphore(10), PoolMeter("quiet", 10, clock=SYSTEM_CLOCK))
    for _ in range(5):
        assert all(hold_slots(slots, takers=2, hold_s=0.03, timeout_s=1))
    report = slots.meter.report()
    # No wait is asserted: a loaded machine may stop the process while a taker takes a
    # free slot. What is recommended follows what was used.
    assert report.in_use_p99 <= 2 and report.timeouts == 0
    assert 1 <= report.recommended <= 3, report


def keep_taking(slots: MeteredSlots, takers: int, hold_s: float, seconds: float) -> None:
    """``takers`` greenlets taking a slot for ``hold_s`` again and again, for ``seconds``."""
    ends = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < ends:
            assert slots.acquire(timeout=5)
            gevent.sleep(hold_s)
            slots.release()

    gevent.joinall([gevent.spawn(loop) for _ in range(takers)], raise_error=True)


def test_idle_time_counts_as_idle_and_a_burst_after_it_is_recommended_what_it_used() -> None:
    slots = MeteredSlots(
        BoundedSemaphore(4), PoolMeter("idle-then-burst", 4, window_s=1.2, clock=SYSTEM_CLOCK)
    )
    assert all(hold_slots(slots, takers=4, hold_s=0.05, timeout_s=1))
    gevent.sleep(1.5)  # longer than the window: the first burst has left it
    idle = slots.meter.report()
    assert idle.offered_per_s == 0 and idle.window_s <= 1.2 + 0.2, idle

    keep_taking(slots, takers=8, hold_s=0.05, seconds=1.2)  # under load for a window
    report = slots.meter.report()
    # The window is the last 1.2 s, not stretched back to the first burst.
    assert 1.2 - 0.01 <= report.window_s <= 1.2 + 0.2 + 0.01, report
    assert report.in_use_p99 == 4 and report.wait_p99_ms > 0
    assert report.recommended >= report.in_use_p99 and report.recommended > report.size, report
    assert report.limited_by == "slots"


def test_advice_is_never_below_what_was_in_use_at_p99() -> None:
    # Ten slots in use for an instant, once, in a long window: Little's law alone says 1.
    slots = MeteredSlots(
        BoundedSemaphore(10), PoolMeter("spike", 10, window_s=2.0, clock=SYSTEM_CLOCK)
    )
    assert all(hold_slots(slots, takers=10, hold_s=0.01, timeout_s=1))
    gevent.sleep(0.5)
    report = slots.meter.report()
    assert report.in_use_p99 >= 9 and report.recommended >= report.in_use_p99, report
    assert report.limited_by == ""


@pytest.mark.parametrize("shared", [False, True], ids=["own-cores", "cores-shared"])
def test_a_pool_whose_waits_come_from_a_saturated_cpu_is_not_told_to_grow(shared: bool) -> None:
    """Saturated whether the loop has a core to itself or shares the cores with busy
    processes (then it runs part of the time and waits, ready, the rest)."""
    hogs = (
        [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import time\nend = time.time() + 3\nwhile time.time() < end: pass",
                ]
            )
            for _ in range(os.cpu_count() or 2)
        ]
        if shared
        else []
    )
    try:
        _cpu_starved_pool_is_told_cpu()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _cpu_starved_pool_is_told_cpu() -> None:
    slots = MeteredSlots(
        BoundedSemaphore(2), PoolMeter("cpu-starved", 2, window_s=5.0, clock=SYSTEM_CLOCK)
    )
    stop = time.monotonic() + 1.0

    def burn() -> None:  # the event loop's work: no idle moment while it runs
        while time.monotonic() < stop:
            sum(range(20_000))
            gevent.sleep(0)

    burner = gevent.spawn(burn)
    assert all(hold_slots(slots, takers=12, hold_s=0.05, timeout_s=10))
    burner.join()
    report = slots.meter.report()
    assert report.wait_p99_ms > 0
    assert report.limited_by == "cpu", report
    assert report.recommended == report.size, report


def _pool(name: str, **values: object) -> dict[str, Any]:
    base = {
        "name": name,
        "size": 10,
        "in_use": 0,
        "in_use_p99": 0,
        "wait_p99_ms": 0.0,
        "offered_per_s": 0.0,
        "hold_ms": 0.0,
        "timeouts": 0,
        "recommended": 10,
        "window_s": 60.0,
        "limited_by": "",
    }
    return {**base, **values}


def _report(pools: list[Any], limit: int, in_flight: int) -> dict[str, Any]:
    return {
        "pools": pools,
        "admission_limit": limit,
        "calls_in_flight": in_flight,
        "calls_queued": 0,
        "tasks_started": 100,
        "tasks_coalesced": 5,
    }


def test_a_group_report_adds_the_workers_up_and_keeps_each_one_labelled() -> None:
    from service.rpc.pool_report import group_report

    reports = {
        "1": _report(
            [
                _pool(
                    "mongo",
                    in_use=4,
                    offered_per_s=30.0,
                    hold_ms=20.0,
                    wait_p99_ms=5.0,
                    recommended=12,
                    limited_by="slots",
                )
            ],
            40,
            3,
        ),
        "0": _report(
            [
                _pool("mongo", in_use=1, offered_per_s=10.0, hold_ms=60.0, wait_p99_ms=1.0),
                _pool("alerts", size=20, recommended=20),
            ],
            30,
            1,
        ),
    }
    group = group_report("1", reports)
    assert group.worker == "1" and [w.worker for w in group.workers] == ["0", "1"]
    assert (group.admission_limit, group.calls_in_flight, group.tasks_started) == (70, 4, 200)
    mongo, alerts = group.pools
    assert (mongo.name, mongo.size, mongo.in_use, mongo.recommended) == ("mongo", 20, 5, 22)
    assert mongo.offered_per_s == 40.0 and mongo.wait_p99_ms == 5.0 and mongo.limited_by == "slots"
    assert mongo.hold_ms == 30.0  # weighted by arrivals: (30 x 20 + 10 x 60) / 40
    assert (alerts.name, alerts.size) == ("alerts", 20)
    assert [p.name for p in group.workers[0].pools] == ["mongo", "alerts"]
    assert group.workers[1].admission_limit == 40


def test_an_idle_workers_pool_adds_no_advice_to_the_groups_recommendation() -> None:
    """An idle worker's recommendation is its size ("nothing measured"): the group's comes
    from the workers with traffic, as though every worker had their load."""
    from service.rpc.pool_report import group_report

    busy = _pool("mongo", size=31, offered_per_s=50.0, recommended=3, in_use_p99=2)
    idle = _pool("mongo", size=31, recommended=31)
    group = group_report("0", {"0": _report([busy], 40, 2), "1": _report([idle], 40, 0)})
    assert (group.pools[0].size, group.pools[0].recommended) == (62, 6)
    both = group_report("0", {"0": _report([busy], 40, 2), "1": _report([busy], 40, 2)})
    assert both.pools[0].recommended == 6
    asleep = group_report("0", {"0": _report([idle], 40, 0), "1": _report([idle], 40, 0)})
    assert asleep.pools[0].recommended == 62
