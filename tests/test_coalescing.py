"""Request coalescing: identical lookups in flight share one call, and nothing else is shared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gevent
import gevent.event
import pytest
from gevent import GreenletExit

from lookups.deadline import Deadline
from service.engine.coalescing import CoalescedWaitTimeout, Coalescer, LeaderGone


class Backend:
    """Counts calls; each call waits for ``release`` then answers or raises."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.release = gevent.event.Event()

    def fetch(
        self, key: Any, answer: Any = None, error: Exception | None = None
    ) -> Callable[[], Any]:
        def call() -> Any:
            self.calls.append(key)
            self.release.wait(timeout=5)
            if error is not None:
                raise error
            return answer if answer is not None else ("value of", key)

        return call


def spawn_calls(
    coalescer: Coalescer,
    backend: Backend,
    keys: list[Any],
    budget_s: float = 5.0,
    **fetch_args: Any,
) -> list[gevent.Greenlet]:
    calls = [
        gevent.spawn(
            coalescer.call, key, Deadline.after_s(budget_s), backend.fetch(key, **fetch_args)
        )
        for key in keys
    ]
    gevent.sleep(0.01)  # every caller has asked
    return calls


def test_identical_calls_in_flight_share_one_backend_call() -> None:
    coalescer, backend = Coalescer(), Backend()
    joined: list[int] = []
    calls = [
        gevent.spawn(
            coalescer.call, "k", Deadline.after_s(5.0), backend.fetch("k"), lambda: joined.append(1)
        )
        for _ in range(10)
    ]
    gevent.sleep(0.01)
    assert coalescer.in_flight == 1
    backend.release.set()
    values = [c.get(timeout=5) for c in calls]
    assert backend.calls == ["k"]
    assert values == [("value of", "k")] * 10 and all(v is values[0] for v in values)
    assert (coalescer.stats.leaders, coalescer.stats.followers, len(joined)) == (1, 9, 9)
    assert coalescer.in_flight == 0


def test_different_keys_never_share() -> None:
    coalescer, backend = Coalescer(), Backend()
    keys = [("errors", app, 0, 1) for app in ("shop", "shop", "blog", "blog", "shop")]
    keys.append(("errors", "shop", 0, 2))  # the same app over another window
    calls = spawn_calls(coalescer, backend, keys)
    backend.release.set()
    assert [c.get(timeout=5) for c in calls] == [("value of", key) for key in keys]
    assert sorted(backend.calls) == sorted(set(keys))


def test_a_failure_reaches_only_those_waiting_for_it() -> None:
    coalescer, backend = Coalescer(), Backend()
    calls = spawn_calls(coalescer, backend, ["k"] * 3, error=ConnectionError("backend down"))
    backend.release.set()
    for call in calls:
        with pytest.raises(ConnectionError, match="backend down"):
            call.get(timeout=5)
    # Nothing is remembered: the next caller makes a call of its own, and may succeed.
    assert coalescer.call("k", Deadline.after_s(5.0), backend.fetch("k", answer="fresh")) == "fresh"
    assert backend.calls == ["k", "k"]


def test_calls_one_after_another_are_not_cached() -> None:
    coalescer, backend = Coalescer(), Backend()
    backend.release.set()
    assert [coalescer.call("k", Deadline.after_s(1.0), backend.fetch("k")) for _ in range(3)] == [
        ("value of", "k")
    ] * 3
    assert backend.calls == ["k"] * 3


def test_a_follower_waits_no_longer_than_its_own_budget() -> None:
    coalescer, backend = Coalescer(), Backend()
    leader = gevent.spawn(coalescer.call, "k", Deadline.after_s(5.0), backend.fetch("k"))
    gevent.sleep(0.01)
    with pytest.raises(CoalescedWaitTimeout) as caught:
        coalescer.call("k", Deadline.after_s(0.05), backend.fetch("k"))
    assert isinstance(caught.value, TimeoutError) and caught.value.retryable
    backend.release.set()
    assert leader.get(timeout=5) == ("value of", "k")  # the leader carried on
    assert backend.calls == ["k"]


def test_a_killed_leader_wakes_its_followers_with_an_error() -> None:
    coalescer, backend = Coalescer(), Backend()
    leader = gevent.spawn(coalescer.call, "k", Deadline.after_s(5.0), backend.fetch("k"))
    gevent.sleep(0.01)
    followers = [
        gevent.spawn(coalescer.call, "k", Deadline.after_s(5.0), backend.fetch("k"))
        for _ in range(3)
    ]
    gevent.sleep(0.01)
    leader.kill(GreenletExit, block=True)
    for follower in followers:
        with pytest.raises(LeaderGone):
            follower.get(timeout=1)
    assert coalescer.in_flight == 0 and backend.calls == ["k"]
