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
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "ANONYMOUS",
    "OTHER",
    "CALLER_PATTERN",
    "CALLER_RULE",
    "ACTIVE_S",
    "RATE_WINDOW_S",
    "LABELLED_CALLERS",
    "CallerShare",
    "CallerShares",
    "CallerCounts",
]

log = logging.getLogger(__name__)

#: The caller of a call that says nothing of who it is, over a connection without a
#: client certificate.
ANONYMOUS = "anonymous"
#: What a caller's name may be: a certificate's DNS name or URI (``spiffe://...``), or a
#: name the caller gives (``RequestMeta.caller``, ``[callers.<name>]``).
CALLER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}")
CALLER_RULE = (
    "must be 1-128 characters of letters, digits, '.', '_', ':', '/', '@' or '-', "
    "starting with a letter or digit"
)
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


class CallerShare:
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


class CallerShares:
    """The callers active now, their weights, and each one's share of a limit.

    ``weights`` by name (others weigh 1); ``clock`` in monotonic seconds.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        max_callers: int,
        clock: Callable[[], float],
        labelled: int = LABELLED_CALLERS,
    ) -> None:
        self._weights = dict(weights)
        self._max = max(1, max_callers)
        self._clock = clock
        self._active: OrderedDict[str, CallerShare] = OrderedDict()  # least recent first
        self._active_weight = 0.0
        self._labels = set(self._weights)
        self._labelled_left = labelled
        self.counts = {name: CallerCounts() for name in self._weights}  # by label
        self._window_at = clock()
        self._admitted_in_window = 0
        self._admitted_per_s = 0.0

    def arrived(self, name: str) -> CallerShare:
        """A call from ``name`` arrived now: its caller, tracked and active."""
        now = self._clock()
        share = self._active.get(name)
        if share is None:
            share = self._track(name, now)
        else:
            share.seen_at = now
            self._active.move_to_end(name)
        share.asked += 1
        if now - self._window_at >= RATE_WINDOW_S:
            self._measure_rates(now)
        self._expire(now)
        return share

    def over(self, share: CallerShare, limit: float) -> bool:
        """Whether one more call of ``share``'s caller would take its demand (calls in flight
        and waiting) past its share of ``limit`` (a caller alone has all of it). Demand, not
        in flight alone: a caller with hundreds of calls waiting is the storm, even while few
        of them run."""
        if share.inflight + share.waiting < self._share_of(share, limit):
            return False
        asked_per_s = share.asked_per_s
        return asked_per_s is None or asked_per_s >= self._share_of(share, self._admitted_per_s)

    def runs_under(self, share: CallerShare, limit: float) -> bool:
        """Whether ``share``'s caller has fewer calls in flight than its share of ``limit``
        (its waiting calls aside): a freed slot may still go to it."""
        return share.inflight < self._share_of(share, limit)

    def contended(self, limit: float) -> bool:
        """Whether callers contend for ``limit``: one active caller is over its share while
        another is within its own. O(active callers): for a rare look (a window of the
        CPU rule), never per call."""
        over = within = False
        for share in self._active.values():
            if self.over(share, limit):
                over = True
            else:
                within = True
            if over and within:
                return True
        return False

    def others_active(self, share: CallerShare) -> bool:
        """Whether callers other than ``share``'s are active now."""
        return self._active_weight > share.weight * (1 + 1e-9)

    def admitted(self, share: CallerShare) -> None:
        share.inflight += 1
        self._admitted_in_window += 1
        counts = self.counts[share.label]
        counts.admitted += 1
        counts.inflight += 1
        if share.refusing and self._clock() - share.refused_at >= _QUIET_S:
            self._stop_refusing(share)

    def done(self, share: CallerShare) -> None:
        share.inflight -= 1
        self.counts[share.label].inflight -= 1

    def refused(self, share: CallerShare) -> None:
        self.counts[share.label].refused += 1
        share.refused_at = self._clock()
        if not share.refusing:
            share.refusing = True
            log.info(
                "caller %s: calls refused (%d in flight, weight %g)",
                share.name,
                share.inflight,
                share.weight,
            )

    def shares(self, limit: float) -> dict[str, float]:
        """Each label's fair share of ``limit`` now: its active callers' shares added up."""
        found: dict[str, float] = {}
        for share in self._active.values():
            found[share.label] = found.get(share.label, 0.0) + self._share_of(share, limit)
        return found

    def _share_of(self, share: CallerShare, limit: float) -> float:
        """Calls of ``limit`` that are ``share``'s caller's fair share now (all of it, alone;
        its weight counts even once forgotten past ``max_callers``)."""
        return limit * share.weight / max(self._active_weight, share.weight)

    def weight_of(self, label: str) -> float:
        """A label's weight: its configured one, else 1 (``other``: each of its callers')."""
        return self._weights.get(label, 1.0)

    def __len__(self) -> int:
        return len(self._active)

    def _track(self, name: str, now: float) -> CallerShare:
        if len(self._active) >= self._max:
            self._forget(self._active.popitem(last=False)[1])
        share = CallerShare(name, self._label(name), self._weights.get(name, 1.0), now)
        self._active[name] = share
        self._active_weight += share.weight
        return share

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
        for share in self._active.values():
            whole = share.tracked_at <= self._window_at
            share.asked_per_s = share.asked / elapsed if whole else None
            share.asked = 0
        self._admitted_per_s = self._admitted_in_window / elapsed
        self._window_at, self._admitted_in_window = now, 0

    def _expire(self, now: float) -> None:
        """Forget the callers no longer active; one still in flight is looked at again in
        a while. Each is looked at about once per :data:`ACTIVE_S`: O(1) a call, amortised."""
        for _ in range(len(self._active)):
            share = next(iter(self._active.values()))
            if now - share.seen_at < ACTIVE_S:
                return
            if share.inflight or share.waiting:
                share.seen_at = now
                self._active.move_to_end(share.name)
            else:
                del self._active[share.name]
                self._forget(share)

    def _forget(self, share: CallerShare) -> None:
        self._active_weight = max(0.0, self._active_weight - share.weight)
        if share.refusing:
            self._stop_refusing(share)

    def _stop_refusing(self, share: CallerShare) -> None:
        share.refusing = False
        log.info("caller %s: no longer refused", share.name)
