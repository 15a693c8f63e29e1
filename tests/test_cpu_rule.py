"""Unit tests of the least latency of :mod:`service.overload.cpu_rule` on a clock the test
moves: the least of two epochs, and the lull's life (when it opens, which calls it waits
for, when it ends). How admission steps its limit with it is in ``test_admission.py``."""

from __future__ import annotations

import pytest

from service.overload.cpu_rule import EPOCH_S, LULL_CALLS, CpuRule, LeastLatency
from service.testing import FakeClock


def test_the_least_is_the_least_of_this_epoch_and_the_last() -> None:
    clock = FakeClock()
    least = LeastLatency(clock)
    least.sample(0.02)
    clock.now += EPOCH_S
    least.roll()
    least.sample(0.05)
    assert least.seconds == 0.02  # the last epoch's still counts
    clock.now += EPOCH_S
    least.roll()
    assert least.seconds == 0.05  # two epochs old: forgotten (a backend slowed)


def test_a_lull_caps_the_calls_in_flight_only_while_it_runs() -> None:
    clock = FakeClock()
    least = LeastLatency(clock)
    assert least.cap(20.0) == 20
    assert least.start_lull() and least.lulling
    assert least.cap(20.0) == LULL_CALLS and least.cap(2.0) == 2
    assert not least.start_lull()  # one at a time


def test_a_lull_waits_for_calls_that_started_under_it_not_those_before() -> None:
    clock = FakeClock()
    least = LeastLatency(clock)
    least.start_lull()
    clock.now += 0.05
    for _ in range(10):  # calls from before the lull drain: none counts
        assert not least.sample(0.04)
    least.admitted()  # the first call under the lull: it opens
    clock.now += 0.02
    for number in range(LULL_CALLS):
        ended = least.sample(0.015)  # started 5 ms after the lull opened
        assert ended == (number == LULL_CALLS - 1)
    assert not least.lulling and least.seconds == 0.015 and least.lulls == 1


def test_one_lull_an_epoch_and_none_runs_for_ever() -> None:
    clock = FakeClock()
    least = LeastLatency(clock)
    least.start_lull()
    clock.now += 1.0  # no call came: the lull gives up at the next one
    assert least.sample(0.04) and not least.lulling
    clock.now += EPOCH_S / 2
    assert not least.start_lull()  # this epoch had its lull
    clock.now += EPOCH_S / 2
    assert least.start_lull() and least.lulls == 2


def test_a_call_of_no_time_at_all_is_no_division_by_zero() -> None:
    """A latency of 0 (a clock's tick too coarse) must not take admission down."""
    clock = FakeClock()
    rule = CpuRule(clock, lambda: clock.now - 1000.0, saturated_share=0.97)
    rule.call_ended(0.0)
    rule.call_ended(0.02)
    clock.now += 0.3
    assert rule.saturated()
    assert rule.saturated_step(demand=True) == pytest.approx(0.9)


def _step(queue: float, contended: bool) -> float:
    """The limit's step after a saturated window whose calls took ``queue`` times the least."""
    clock = FakeClock()
    rule = CpuRule(clock, lambda: clock.now - 1000.0, saturated_share=0.97)
    rule.least.sample(0.02)
    rule.call_ended(0.02 * queue)
    clock.now += 0.3
    assert rule.saturated()
    return rule.saturated_step(demand=True, contended=lambda: contended)


@pytest.mark.parametrize(
    ("queue", "alone", "contended"),
    [
        (2.5, 0.9, 0.9),
        (1.8, 1.0, 0.9),
        (1.4, 1 / 0.9, 0.9),
        (1.2, 1 / 0.9, 1.0),
        (1.05, 1 / 0.9, 1 / 0.9),
    ],
)
def test_while_callers_contend_the_queue_for_the_core_is_held_shorter(
    queue: float, alone: float, contended: float
) -> None:
    assert _step(queue, contended=False) == pytest.approx(alone)
    assert _step(queue, contended=True) == pytest.approx(contended)
