"""A backend's slots go to the waiting task of the most critical call first, then fairly
among callers by weight (start-time fair queueing), and leaving the line (a timeout, a
kill) loses no slot."""

from __future__ import annotations

from typing import Any

import gevent
import gevent.event
import pytest

from lookups.backends.ordered_slots import OrderedSlots
from lookups.flow import Flow


def _waiting_at(slots: OrderedSlots, place: int, served: list[int], hold_s: float = 0.0) -> None:
    if slots.acquire(timeout=5, flow=Flow(rank=place)):
        served.append(place)
        gevent.sleep(hold_s)
        slots.release()


def _serve(slots: OrderedSlots, waiting: list[Flow]) -> list[str]:
    """With every slot taken, one task of each flow of ``waiting`` in turn joins the line;
    then the slots come back: the callers in the order they were served."""
    served: list[str] = []

    def task(flow: Flow) -> None:
        assert slots.acquire(timeout=5, flow=flow)
        served.append(flow.caller)
        slots.release()

    tasks = []
    for flow in waiting:
        tasks.append(gevent.spawn(task, flow))
        gevent.sleep(0)
    slots.release()
    gevent.joinall(tasks, timeout=5, raise_error=True)
    return served


def test_a_slot_given_back_goes_to_the_lowest_place_then_the_longest_waiting() -> None:
    slots, served = OrderedSlots(1), list[Any]()
    assert slots.acquire()
    waiters = []
    for place in (3, 1, 2, 1, 0):  # each in the line before the next comes
        waiters.append(gevent.spawn(_waiting_at, slots, place, served))
        gevent.sleep(0)
    slots.release()
    gevent.joinall(waiters, timeout=5, raise_error=True)
    assert served == [0, 1, 1, 2, 3]
    assert slots.acquire(blocking=False)  # every slot came back


def test_a_caller_new_to_the_line_is_served_ahead_of_a_storms_backlog() -> None:
    slots = OrderedSlots(1)
    assert slots.acquire()
    storm, polite = Flow(caller="storm"), Flow(caller="polite")
    served = _serve(slots, [storm] * 5 + [polite])
    assert served == ["storm", "polite", "storm", "storm", "storm", "storm"]


def test_callers_always_waiting_are_served_in_the_ratio_of_their_weights() -> None:
    slots = OrderedSlots(1)
    assert slots.acquire()
    heavy, light = Flow(caller="heavy", weight=3.0), Flow(caller="light")
    served = _serve(slots, [heavy] * 6 + [light] * 2)
    assert served == ["heavy", "light", "heavy", "heavy", "heavy", "light", "heavy", "heavy"]


def test_the_more_critical_go_first_whatever_their_callers_used() -> None:
    slots = OrderedSlots(1)
    assert slots.acquire()
    storm = Flow(rank=1, caller="storm")
    served = _serve(
        slots, [storm] * 3 + [Flow(rank=2, caller="report"), Flow(rank=0, caller="page")]
    )
    assert served == ["page", "storm", "storm", "storm", "report"]


def test_a_waiter_that_gives_up_or_is_killed_leaves_the_line_and_no_slot_is_lost() -> None:
    slots, served = OrderedSlots(2), list[Any]()
    assert slots.acquire() and slots.acquire()
    assert not slots.acquire(timeout=0.01)  # gave up: out of the line
    killed = gevent.spawn(_waiting_at, slots, 0, served)
    last = gevent.spawn(_waiting_at, slots, 5, served)
    gevent.sleep(0)
    killed.kill()  # interrupted while waiting, before any slot came
    slots.release()
    last.join(timeout=5)
    assert served == [5]
    slots.release()
    assert slots.acquire(blocking=False) and slots.acquire(blocking=False)
    assert not slots.acquire(blocking=False)


def test_a_slot_handed_to_a_waiter_killed_before_it_woke_goes_to_the_next() -> None:
    slots, served = OrderedSlots(1), list[Any]()
    assert slots.acquire()
    first = gevent.spawn(_waiting_at, slots, 0, served, 0.01)
    second = gevent.spawn(_waiting_at, slots, 1, served)
    gevent.sleep(0)
    first.kill(block=False)  # the kill is on its way (a callback of the loop's) ...
    slots.release()  # ... when the slot is handed to it: it wakes to the kill, not the slot
    second.join(timeout=5)
    assert served == [1]
    assert slots.acquire(blocking=False)


def test_releasing_more_than_was_taken_is_refused() -> None:
    slots = OrderedSlots(1)
    with pytest.raises(ValueError):
        slots.release()


class _Line:
    """One slot, held by the test; tasks join the line in flows and keep the slot until
    the test hands it on with :meth:`serve`, so callers can join while the line moves."""

    def __init__(self) -> None:
        self.slots = OrderedSlots(1)
        assert self.slots.acquire()
        self.served: list[str] = []
        self._tasks: list[gevent.Greenlet] = []
        self._done = gevent.event.Event()

    def join(self, flow: Flow, count: int = 1) -> None:
        for _ in range(count):
            self._tasks.append(gevent.spawn(self._task, flow))
            gevent.sleep(0)  # in the line before the next comes

    def _task(self, flow: Flow) -> None:
        assert self.slots.acquire(timeout=5, flow=flow)
        self.served.append(flow.caller)

    def serve(self, count: int) -> list[str]:
        """Hand the slot on ``count`` times: the callers served, in order."""
        before = len(self.served)
        for _ in range(count):
            self.slots.release()  # from the holder to the next in the line
            gevent.sleep(0)
        return self.served[before:]

    def close(self) -> None:
        while self.slots._waiting:
            self.slots.release()
            gevent.sleep(0)
        gevent.joinall(self._tasks, timeout=5, raise_error=True)


def test_a_caller_back_with_a_burst_while_the_line_moves_shares_it_with_the_storm() -> None:
    """The virtual time follows the line: a caller that comes back after the storm's tasks
    moved it on starts there, beside the storm's next task, not at its own old finish
    tag, far behind the storm's and so ahead of its whole backlog."""
    line = _Line()
    storm, polite = Flow(caller="storm"), Flow(caller="polite")
    line.join(storm, 30)
    line.join(polite)
    assert line.serve(12).count("polite") == 1  # served once, early
    line.join(polite, 8)  # back with a burst; eighteen of the storm's still wait
    served = line.serve(8)
    assert 3 <= served.count("storm") <= 5, served  # one for one, as two callers waiting
    line.close()


def test_a_line_that_empties_starts_every_caller_again_at_the_virtual_time() -> None:
    """A light caller's burst, served alone, left its finish tag far ahead; once the line
    is empty that is forgotten, and it queues beside a newcomer by arrival again."""
    line = _Line()
    light, other = Flow(caller="light", weight=0.25), Flow(caller="other")
    line.join(light, 4)
    assert line.serve(4) == ["light"] * 4  # the line is empty again
    line.join(light)
    line.join(other, 3)
    assert line.serve(4) == ["light", "other", "other", "other"]
    line.close()
