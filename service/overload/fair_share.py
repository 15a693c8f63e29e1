"""Fair share per caller: admission's limit divided among the callers active now.

**Who the caller is** (decided by :meth:`service.overload.gate.CallGate.admitted`): the
name of the client certificate of a mutual-TLS connection, else the ``RequestMeta.caller``
the call carries, else one shared :data:`ANONYMOUS` caller. A name the caller gives
itself serves fairness, not security: anyone may claim any name.

**A caller's share** is admission's limit times its weight (``[callers.<name>] weight``,
1 by default) over the weights of the callers active now: those with a call in flight or
one arrived within the last :data:`ACTIVE_S`; it is over its share while its calls in
flight and waiting are as many or more, and it asks for calls faster than its share of
the calls admitted a second (each measured over the last whole :data:`RATE_WINDOW_S`).
The rate keeps a caller asking for less than its share within it when its calls bunch up
for a moment (its calls arrive at random, and the limit moves), which counts alone would
not; the counts keep a caller whose rate is not known yet, or whose calls hold slots
long, from taking more than its share of them. Nothing is reserved: below the limit every
call is admitted, whoever asks, so a caller alone may use all of it (work-conserving, as
the partitions of Netflix's concurrency-limits borrow what the others leave). Once the
limit is reached, admission (:mod:`service.overload.admission`) still admits a call from
a caller under its share while others are active (the limit was reached by callers over
theirs), so the calls it queues and refuses are those of the callers above their share.
Criticality still comes first; fairness orders the calls of one criticality. A refusal to
a caller under its share is never held, and tells it the shortest pause
(:mod:`service.overload.gate`).

**Bounded**: at most ``admission.max_callers`` callers are tracked, the least recently
active forgotten first; each call costs a few dictionary operations; there is no thread.
**Counted by label**: the callers named in the configuration, then the first
:data:`LABELLED_CALLERS` other names seen, each count under their own name for as long
as the process lives; every other caller counts as :data:`OTHER`. So a metric's label
values stay few, and its counts are exact and never go back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from lookups.clock import Clock

__all__ = [
    "ANONYMOUS",
    "OTHER",
    "ACTIVE_S",
    "RATE_WINDOW_S",
    "LABELLED_CALLERS",
    "CallerState",
    "FairShare",
    "CallerCounts",
]

log = logging.getLogger(__name__)

#: The caller of a call that says nothing of who it is, over a connection without a
#: client certificate.
ANONYMOUS = "anonymous"
#: The label every caller past the labelled ones counts under.
OTHER = "other"
#: A caller without a call in flight is active this long after its last call arrived.
ACTIVE_S = 1.0
#: How many names, besides the configured ones, get their own label.
LABELLED_CALLERS = 20
#: The window over which callers' asking rates and the admission rate are measured.
RATE_WINDOW_S = 1.0
#: A caller refused is said to be no longer refused once this long passed without a refusal.
_QUIET_S = 5.0


class CallerState:
    """One caller's state: its weight, its calls in flight and waiting for admission, when it
    was last active."""

    __slots__ = (
        "name",
        "label",
        "weight",
        "inflight",
        "waiting",
        "seen_at",
        "refused_at",
        "refusing",
        "asked",
        "asked_per_s",
        "tracked_at",
    )

    def __init__(self, name: str, label: str, weight: float, now: float) -> None:
        self.name, self.label, self.weight = name, label, weight
        self.inflight = 0
        self.waiting = 0  # admission's waiting line counts them in and out
        self.seen_at = now
        self.refused_at = 0.0
        self.refusing = False
        self.asked = 0  # calls arrived in the current rate window
        self.asked_per_s: float | None = None  # over the last whole window; None: not known
        self.tracked_at = now


@dataclass
class CallerCounts:
    """One label's calls: admitted and refused since start, in flight now."""

    admitted: int = 0
    refused: int = 0
    inflight: int = 0


class FairShare:
    """The callers active now, their weights, and each one's share of a limit.

    ``weights`` by name (others weigh 1); ``clock`` the service's. Not ``enabled``
    (``admission.fair_share`` off), callers are still counted, and no caller is ever over
    or under its share.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        max_callers: int,
        clock: Clock,
        labelled: int = LABELLED_CALLERS,
        enabled: bool = True,
    ) -> None:
        self._enabled = enabled
        self._weights = dict(weights)
        self._max = max(1, max_callers)
        self._clock = clock
        self._active: OrderedDict[str, CallerState] = OrderedDict()  # least recent first
        self._active_weight = 0.0
        self._labels = set(self._weights)
        self._labelled_left = labelled
        self.counts = {name: CallerCounts() for name in self._weights}  # by label
        self._window_at = clock.monotonic()
        self._admitted_in_window = 0
        self._admitted_per_s = 0.0

    @property
    def enabled(self) -> bool:
        """Whether callers are ever over or under their shares (``admission.fair_share``)."""
        return self._enabled

    def arrived(self, name: str) -> CallerState:
        """A call from ``name`` arrived now: its caller, tracked and active."""
        now = self._clock.monotonic()
        caller = self._active.get(name)
        if caller is None:
            caller = self._track(name, now)
        else:
            caller.seen_at = now
            self._active.move_to_end(name)
        caller.asked += 1
        if now - self._window_at >= RATE_WINDOW_S:
            self._measure_rates(now)
        self._expire(now)
        return caller

    def over(self, caller: CallerState, limit: float) -> bool:
        """Whether one more call of ``caller`` would take its demand (calls in flight
        and waiting) past its share of ``limit`` (a caller alone has all of it). Demand, not
        in flight alone: a caller with hundreds of calls waiting is the storm, even while few
        of them run."""
        if not self._enabled or caller.inflight + caller.waiting < self._share_of(caller, limit):
            return False
        asked_per_s = caller.asked_per_s
        return asked_per_s is None or asked_per_s >= self._share_of(caller, self._admitted_per_s)

    def under(self, caller: CallerState, limit: float) -> bool:
        """Whether ``caller`` is under its share of ``limit`` while other callers are active:
        refusals of its calls would come of another's demand."""
        return self._others_active(caller) and not self.over(caller, limit)

    def runs_under(self, caller: CallerState, limit: float) -> bool:
        """Whether ``caller`` has fewer calls in flight than its share of ``limit`` while
        other callers are active, however many it has waiting: a freed slot may still go
        to it."""
        return self._others_active(caller) and caller.inflight < self._share_of(caller, limit)

    def contended(self, limit: float) -> bool:
        """Whether callers contend for ``limit``: one active caller is over its share while
        another is within its own. O(active callers): for a rare look (a window of the
        CPU rule), never per call."""
        over = within = False
        for caller in self._active.values():
            if self.over(caller, limit):
                over = True
            else:
                within = True
            if over and within:
                return True
        return False

    def _others_active(self, caller: CallerState) -> bool:
        """Whether callers other than ``caller`` are active now (never, not enabled)."""
        return self._enabled and self._active_weight > caller.weight * (1 + 1e-9)

    def admitted(self, caller: CallerState) -> None:
        caller.inflight += 1
        self._admitted_in_window += 1
        counts = self.counts[caller.label]
        counts.admitted += 1
        counts.inflight += 1
        if caller.refusing and self._clock.monotonic() - caller.refused_at >= _QUIET_S:
            self._stop_refusing(caller)

    def done(self, caller: CallerState) -> None:
        caller.inflight -= 1
        self.counts[caller.label].inflight -= 1

    def refused(self, caller: CallerState) -> None:
        self.counts[caller.label].refused += 1
        caller.refused_at = self._clock.monotonic()
        if not caller.refusing:
            caller.refusing = True
            log.info(
                "caller %s: calls refused (%d in flight, weight %g)",
                caller.name,
                caller.inflight,
                caller.weight,
            )

    def shares(self, limit: float) -> dict[str, float]:
        """Each label's fair share of ``limit`` now: its active callers' shares added up."""
        found: dict[str, float] = {}
        for caller in self._active.values():
            found[caller.label] = found.get(caller.label, 0.0) + self._share_of(caller, limit)
        return found

    def _share_of(self, caller: CallerState, limit: float) -> float:
        """Calls of ``limit`` that are ``caller``'s fair share now (all of it, alone;
        its weight counts even once forgotten past ``max_callers``)."""
        return limit * caller.weight / max(self._active_weight, caller.weight)

    def weight_of(self, label: str) -> float:
        """A label's weight: its configured one, else 1 (``other``: each of its callers')."""
        return self._weights.get(label, 1.0)

    def __len__(self) -> int:
        return len(self._active)

    def _track(self, name: str, now: float) -> CallerState:
        if len(self._active) >= self._max:
            self._forget(self._active.popitem(last=False)[1])
        caller = CallerState(name, self._label(name), self._weights.get(name, 1.0), now)
        self._active[name] = caller
        self._active_weight += caller.weight
        return caller

    def _label(self, name: str) -> str:
        if name not in self._labels and self._labelled_left > 0:
            self._labels.add(name)
            self._labelled_left -= 1
        label = name if name in self._labels else OTHER
        self.counts.setdefault(label, CallerCounts())
        return label

    def _measure_rates(self, now: float) -> None:
        """End the rate window: each active caller's asking rate over it (unknown for one
        tracked since it began), and the calls admitted a second. O(active callers), once a
        window."""
        elapsed = now - self._window_at
        for caller in self._active.values():
            whole = caller.tracked_at <= self._window_at
            caller.asked_per_s = caller.asked / elapsed if whole else None
            caller.asked = 0
        self._admitted_per_s = self._admitted_in_window / elapsed
        self._window_at, self._admitted_in_window = now, 0

    def _expire(self, now: float) -> None:
        """Forget the callers no longer active; one still in flight is looked at again in
        a while. Each is looked at about once per :data:`ACTIVE_S`: O(1) a call, amortised."""
        for _ in range(len(self._active)):
            caller = next(iter(self._active.values()))
            if now - caller.seen_at < ACTIVE_S:
                return
            if caller.inflight or caller.waiting:
                caller.seen_at = now
                self._active.move_to_end(caller.name)
            else:
                del self._active[caller.name]
                self._forget(caller)

    def _forget(self, caller: CallerState) -> None:
        self._active_weight = max(0.0, self._active_weight - caller.weight)
        if caller.refusing:
            self._stop_refusing(caller)

    def _stop_refusing(self, caller: CallerState) -> None:
        caller.refusing = False
        log.info("caller %s: no longer refused", caller.name)
