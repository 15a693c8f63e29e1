"""Request coalescing (singleflight): identical lookups in flight at once share one call.

Dashboards have many viewers of the same application, and each view asks for
the same panels over the same window. :class:`Coalescer` lets the first task
with a given key (the *leader*) make the backend call, and every task that
asks for the same key while that call runs (a *follower*) wait for its result
instead of calling again::

    value = coalescer.call(("errors", app, start_ms, end_ms), deadline,
                           lambda: lookup.fetch(window, deadline))

The rules that keep it honest:

* The key is the whole question: the caller builds it from everything the
  answer depends on (panel, app, window). Nothing else is ever shared.
* A value is shared with the followers waiting when it arrives, and then
  forgotten: no cache, no stale data.
* A failure (an exception, a timeout) is shared only with the followers that
  were waiting for that call; the next task with the key calls again.
* A follower waits no longer than its own deadline; when it passes it raises
  :class:`CoalescedWaitTimeout` (a :class:`TimeoutError`, so the engine reports
  ``TIMEOUT``) and the leader carries on for the others.
* A leader that is killed (``GreenletExit``) or times out on the hub wakes its
  followers with that error rather than leaving them waiting.

Values must be immutable (the lookups' panel values are frozen dataclasses):
every follower receives the same object.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from gevent.event import AsyncResult

from lookups.deadline import Deadline

__all__ = ["Coalescer", "CoalescedWaitTimeout", "LeaderGone", "CoalescingStats"]


class CoalescedWaitTimeout(TimeoutError):
    """A follower's deadline passed while the call it waited for was still running."""

    retryable = True
    backend_fault = False


class LeaderGone(Exception):
    """The leader's greenlet was killed or timed out before its call returned."""

    retryable = True
    backend_fault = False


class CoalescingStats:
    """Counters since start: calls made (``leaders``) and calls saved (``followers``)."""

    __slots__ = ("leaders", "followers")

    def __init__(self) -> None:
        self.leaders = 0
        self.followers = 0


class Coalescer:
    """One table of calls in flight, by key; shared by every request of a process."""

    def __init__(self) -> None:
        self._flights: dict[Hashable, AsyncResult] = {}
        self.stats = CoalescingStats()

    @property
    def in_flight(self) -> int:
        """Keys with a call running now."""
        return len(self._flights)

    def call(
        self,
        key: Hashable,
        deadline: Deadline,
        fetch: Callable[[], Any],
        joined: Callable[[], None] | None = None,
    ) -> Any:
        """``fetch()``'s value, shared with every caller of the same ``key`` meanwhile.

        ``joined`` is called when this caller becomes a follower (to mark its span).
        Raises what ``fetch`` raised (leader or follower), :class:`CoalescedWaitTimeout`
        when a follower's ``deadline`` passes, :class:`LeaderGone` when the leader
        was killed.
        """
        flight = self._flights.get(key)
        if flight is not None:
            self.stats.followers += 1
            if joined is not None:
                joined()
            return _wait(flight, deadline)
        flight = self._flights[key] = AsyncResult()
        self.stats.leaders += 1
        try:
            value = fetch()
        except Exception as error:
            flight.set_exception(error)
            raise
        except BaseException as gone:  # GreenletExit, gevent.Timeout: not ours to share
            flight.set_exception(LeaderGone(f"the shared call ended ({type(gone).__name__})"))
            raise
        else:
            flight.set(value)
            return value
        finally:
            # Forget it at once: a failure reaches only the followers already waiting.
            if self._flights.get(key) is flight:
                del self._flights[key]


def _wait(flight: AsyncResult, deadline: Deadline) -> Any:
    waited_s = deadline.remaining_s()
    if not deadline.clock.join(flight, deadline.at):
        raise CoalescedWaitTimeout(f"the shared call did not finish within {waited_s:.3f}s")
    return flight.get(block=False)
