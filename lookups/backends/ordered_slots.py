"""A backend's slots, shared fairly among the callers waiting for them.

A backend's slots are shared by every call in the process, and when they are all taken a
pool-bound server's calls spend most of their time waiting for one. Served in the order
they came, one caller's storm of tasks, admitted earlier, was served ahead of the tasks
of a polite caller admitted after it: admission's fair share undone at the backend.

So a slot given back goes to the waiting task first by its call's criticality, then by
start-time fair queueing among callers (Goyal et al., SFQ; the classic way to share one
server among flows by weight): each task waiting gets a start tag, the later of the
backend's virtual time and its caller's last finish tag, and moves its caller's finish
tag on by ``1 / weight``; the lowest start goes first, and the backend's virtual time
becomes it. A caller that has not waited lately starts at the virtual time, ahead of a
storm's backlog; two callers always waiting are served in the ratio of their weights.
Not a strict priority by share: a caller over its share whose tasks were always
overtaken had its calls ever slower, and starved (weights 3:1 in ``make bench``'s fair
scenario).

Who the caller is and how much it weighs is the waiter's :class:`~lookups.flow.Flow`,
which its call's deadline carries (the service sets it when it admits the call); a lookup
run outside one waits as the most critical, with no caller (at the virtual time).
gevent's ``BoundedSemaphore`` wakes its waiters in the order they came and takes no key,
hence this one. As with it, waiting is
safe to interrupt (a ``gevent.Timeout``, a kill): a waiter that goes leaves the line, and
a slot handed to one interrupted before it could take it is given back. For the server's
event loop only: nothing here is thread-safe.
"""

from __future__ import annotations

import heapq
import itertools

from gevent.event import Event

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.flow import NO_FLOW, Flow

__all__ = ["OrderedSlots"]

#: Callers' finish tags kept at most, beyond those the line empties of.
_MAX_FLOWS = 4096


class _Waiter:
    __slots__ = ("event", "given", "gone")

    def __init__(self) -> None:
        self.event = Event()
        self.given = False  # a slot was handed to it
        self.gone = False  # it left the line without one


class OrderedSlots:
    """``size`` slots; :meth:`acquire` and :meth:`release` as a bounded semaphore's, the
    timeout counted on ``clock`` (the service's)."""

    def __init__(self, size: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._size = self._free = size
        # A heap: rank, start tag, arrival.
        self._line: list[tuple[int, float, int, _Waiter]] = []
        self._waiting = 0  # waiters in the line that have not gone
        self._arrivals = itertools.count()
        self._virtual = 0.0  # the start tag of the last waiter served
        self._finish: dict[str, float] = {}  # by caller: its last waiter's finish tag

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, flow: Flow = NO_FLOW
    ) -> bool:
        """Take a slot, waiting up to ``timeout`` seconds (None: as long as it takes) in
        the line at ``flow``'s place; False if none was had."""
        if self._free > 0:  # a slot is free only while no one waits
            self._free -= 1
            return True
        if not blocking:
            return False
        waiter = _Waiter()
        heapq.heappush(self._line, (*self._tags(flow), waiter))
        self._waiting += 1
        try:
            if timeout is None:
                waiter.event.wait()
            else:
                self._clock.wait(waiter.event, self._clock.monotonic() + timeout)
        except BaseException:
            if waiter.given:
                self.release()  # handed one as it was interrupted: the next waiter's
            else:
                self._leave(waiter)
            raise
        if not waiter.given:
            self._leave(waiter)
        return waiter.given

    def release(self) -> None:
        """Give a slot back: to the first waiter in the line, else to the free ones."""
        while self._line:
            _, start, _, waiter = heapq.heappop(self._line)
            if not waiter.gone:
                self._virtual = max(self._virtual, start)
                waiter.given = True
                self._waiting -= 1
                if not self._waiting:
                    self._emptied()
                waiter.event.set()
                return
        if self._free >= self._size:
            raise ValueError("slots released more often than acquired")
        self._free += 1

    def _tags(self, flow: Flow) -> tuple[int, float, int]:
        """A new waiter's key: its rank, its start tag, its arrival."""
        start = self._virtual
        if flow.caller:
            start = max(start, self._finish.get(flow.caller, 0.0))
            if len(self._finish) >= _MAX_FLOWS:
                self._forget_caught_up()
            self._finish[flow.caller] = start + 1.0 / flow.weight
        return flow.rank, start, next(self._arrivals)

    def _forget_caught_up(self) -> None:
        """Drop the finish tags at or before the virtual time: those callers start there."""
        self._finish = {name: at for name, at in self._finish.items() if at > self._virtual}

    def _leave(self, waiter: _Waiter) -> None:
        waiter.gone = True  # left where it stands in the heap, skipped when it comes up
        self._waiting -= 1
        if not self._waiting:
            self._emptied()

    def _emptied(self) -> None:
        """No one waits: what is left in the heap has gone, and every caller starts again
        at the virtual time."""
        self._line.clear()
        self._finish.clear()

    def __repr__(self) -> str:
        return f"<OrderedSlots {self._size - self._free}/{self._size}, {self._waiting} waiting>"
