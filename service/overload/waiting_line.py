"""The calls waiting for admission: the more critical first, adaptive LIFO, CoDel.

While the line has drained within the last ``queue_interval_ms``, a waiter may wait
that long, first in, first out; once it has stood longer, waiting is cut to
``queue_target_ms`` and the newest waiter is served first (the oldest are the
likeliest to miss their deadlines): Facebook's adaptive LIFO with CoDel. Within that,
the more critical calls (:class:`~service.overload.brownout.Criticality`) are served
first, and a newcomer finding the line full takes the place of the newest of the
least critical waiters, if it is less critical than the newcomer; that one is refused.

A waiter's *place* is its criticality, then whether its caller is over its fair share
(:mod:`service.overload.fair_share`): ``2 x criticality + over``. So within one
criticality the calls of callers under their share go first, and evict the others. A
caller under its share while others are active does not wait at all (admission lets it
past the limit), so the line holds the calls of callers over their share, or of a caller
alone: CoDel bounds every wait.

Where the callers waiting at one place are all over their share (two storms), the one a
freed slot goes to is, of the next :data:`CHOICE` waiters in order, that of the caller
with the fewest calls in flight for its weight: the weights then share the slots, as
deficit round robin shares a link, instead of the callers' rates of asking. A place is
decided when a call joins, from its caller's demand (calls in flight and waiting); the
choice looks at calls in flight at the moment a slot frees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import islice

from gevent.event import Event

from lookups.clock import Clock
from service.engine.settings import AdmissionSettings
from service.overload.brownout import Criticality
from service.overload.fair_share import CallerState

__all__ = [
    "WaitingLine",
    "Waiter",
    "place_of",
    "criticality_at",
    "PLACES",
    "CHOICE",
]

#: Places in the line: two per criticality (callers under their share, then over).
PLACES = 2 * len(Criticality)
#: How many waiters of the place next in line a freed slot chooses among (fair share on):
#: enough that two or three callers asking at once are each among them, few enough that
#: a hand-over stays O(1).
CHOICE = 8


def place_of(criticality: int, over_share: bool) -> int:
    """A waiter's place: its criticality first, then whether its caller is over its share."""
    return 2 * criticality + over_share


def criticality_at(place: int) -> int:
    """The criticality of the calls at ``place``."""
    return place // 2


class Waiter:
    """One call waiting; ``admitted`` once the line let it in (else it was refused).
    ``place``: see :func:`place_of`; ``caller`` its caller, if known."""

    __slots__ = ("event", "admitted", "place", "caller")

    def __init__(self, place: int, caller: CallerState | None = None) -> None:
        self.event = Event()
        self.admitted = False
        self.place = place
        self.caller = caller


class WaitingLine:
    """The waiters of one :class:`~service.overload.admission.AdmissionControl`.

    ``waiters`` is read directly by admission's fast path: an empty line costs no call.
    """

    def __init__(self, settings: AdmissionSettings, clock: Clock, choice: int = CHOICE) -> None:
        """``choice``: of how many waiters at the front the least served caller's goes
        first (1: the line's own order alone)."""
        self._settings = settings
        self._choice = choice
        self._clock = clock
        self.waiters: deque[Waiter] = deque()
        self._by_place = [0] * PLACES
        self._empty_at = clock.monotonic()

    @property
    def standing(self) -> bool:
        """Whether calls have waited without the line draining for longer than its interval."""
        return (
            bool(self.waiters)
            and self._clock.monotonic() - self._empty_at > self._settings.queue_interval_ms / 1000.0
        )

    def ahead_of(self, place: int) -> int:
        """Waiters a newcomer at ``place`` would wait behind: as far forward or more."""
        return sum(self._by_place[: place + 1])

    def join(self, place: int, caller: CallerState | None = None) -> tuple[Waiter, float]:
        """A new waiter, and the longest it may wait (seconds) as the line stands now."""
        waiter = Waiter(place, caller)
        self.waiters.append(waiter)
        self._by_place[place] += 1
        settings = self._settings
        wait_ms = settings.queue_target_ms if self.standing else settings.queue_interval_ms
        return waiter, wait_ms / 1000.0

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` is out of the line (admitted, refused or gave up); a no-op if it was."""
        try:
            self.waiters.remove(waiter)
        except ValueError:
            return
        self._by_place[waiter.place] -= 1
        if not self.waiters:
            self._empty_at = self._clock.monotonic()

    def evict_behind(self, place: int) -> bool:
        """Refuse the newest of the waiters furthest back, if further back than ``place``."""
        lowest = max(r for r, count in enumerate(self._by_place) if count)
        if lowest <= place:
            return False
        victim = next(w for w in reversed(self.waiters) if w.place == lowest)
        self.leave(victim)
        victim.event.set()  # not admitted: it is refused in its own greenlet
        return True

    def admit_next(self) -> Waiter | None:
        """Let the next waiter in: of the place furthest forward, the newest under a standing
        line, else the oldest."""
        if not self.waiters:
            return None
        newest = self.standing
        top = next(r for r, count in enumerate(self._by_place) if count)
        order = reversed(self.waiters) if newest else iter(self.waiters)
        if self._by_place[top] == len(self.waiters):  # one place waits: the usual case
            candidates = order
        else:
            candidates = (w for w in order if w.place == top)
        waiter = _least_served(islice(candidates, self._choice))
        self.leave(waiter)
        waiter.admitted = True
        waiter.event.set()
        return waiter


def _least_served(candidates: Iterable[Waiter]) -> Waiter:
    """Of ``candidates`` (at least one, in the order the line serves them), the first whose
    caller has the fewest calls in flight for its weight; a waiter of no known caller
    counts as having none."""
    best: Waiter | None = None
    best_load = 0.0
    for waiter in candidates:
        caller = waiter.caller
        load = caller.inflight / caller.weight if caller is not None else 0.0
        if best is None or load < best_load:
            best, best_load = waiter, load
            if load == 0.0:
                break
    assert best is not None, "_least_served needs a candidate"
    return best
