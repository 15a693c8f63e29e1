"""Pacing: a caller that ignores ``retry_after_ms`` gets its next ``Overloaded`` late.

A refusal costs the process a read, a decode and a reply, about a fiftieth of an
admitted call. A caller that honours ``retry_after_ms`` is refused a few times
a second; a caller that tries again at once (a retry loop in a web tier, users
pressing reload) is refused as fast as the process can refuse, and a thousand
such callers take the whole CPU from the calls that were admitted.

A Thrift connection is strictly request-reply: until it has its answer, a
caller sends nothing more on it. So a caller that came back before the pause it
was told gets its next refusal *held*: answered ``Overloaded`` as before, but only
once ``retry_after_ms`` has passed, or shortly before the call's deadline,
whichever is first. The caller is never answered late, and every caller is
throttled to about one refusal per ``retry_after_ms`` (or per deadline) whatever
it does, at the cost of a timer. This module decides how long; the holding is
the server's (:mod:`service.overload.held_connections`, or a sleep in the call's greenlet).

Weighed against the alternatives:

* *Not reading a refused connection until its pause has passed* throttles as
  well, but the next call then waits unread while its caller's clock runs: it
  would be answered late, or be refused on arrival with its budget gone.
* *Pausing all reads at the limit* holds back the polite callers and the
  admitted calls' successors together, and the kernel's buffers fill with calls
  whose deadlines run out unseen.
* *Per-connection fairness* does not help: each of these callers has one call
  in flight, and there are simply too many callers.
* *Adaptive LIFO* (:mod:`~service.overload.admission`) decides which waiting
  call goes first; it does not make refusing cheaper.

Callers that honour ``retry_after_ms`` (with the usual x0.5 to x1.5 jitter) are
never held, so they, and the web-tier client trying another instance, are
refused at once exactly as before. This module knows nothing of Thrift: one
:class:`CallerPacing` stands for one connection.
"""

from __future__ import annotations

import random
import time
from contextvars import ContextVar
from typing import Optional

from lookups.deadline import Deadline

__all__ = ["CallerPacing", "current_caller"]

#: A caller who comes back before this share of the pause it was told has ignored it
#: (callers jitter their pause by x0.5 to x1.5; the rest is slack for the network).
_EARLY_SHARE = 0.4
#: A held refusal is answered within this share of the remaining deadline...
_DEADLINE_SHARE = 0.95
#: ...and at least this much before it, so that the reply reaches the caller in time.
_REPLY_MARGIN_S = 0.05
#: A hold lasts between this share of its longest and the whole of it. Every caller is
#: answered within its deadline, so callers/deadline answers a second is the floor that
#: pacing can bring refusals down to: the longer the holds, the closer (1000 such callers
#: with 2 s deadlines, make bench: 565 and 606 refusals/s with holds of 0.8 to 0.9 of the
#: deadline, 493 and 533/s with 0.9 to 0.95).
_JITTER = 0.9

#: The caller (connection) of the call being served; set by the server per call.
current_caller: ContextVar[Optional["CallerPacing"]] = ContextVar("fanout_caller", default=None)


class CallerPacing:
    """One connection's refusals: when it was told to come back, and whether it did."""

    __slots__ = ("_back_at", "_early", "_last_deadline_ms", "_hold_s")

    def __init__(self) -> None:
        self._back_at = 0.0
        self._early = False
        self._last_deadline_ms = 0.0   # the deadline of this caller's last call read in full
        self._hold_s = 0.0      # how long to hold the reply to the call being served

    def arrived(self, deadline: Deadline) -> None:
        """A call from this caller arrived now (before its admission is decided)."""
        self._early = time.monotonic() < self._back_at
        self._last_deadline_ms = deadline.remaining_ms()

    def back_early(self) -> bool:
        """True if a call arriving now comes before the pause this caller was told."""
        return self._last_deadline_ms > 0 and time.monotonic() < self._back_at

    def early_for_s(self) -> float:
        """Seconds from now until a call from this caller no longer counts as early (0 if none)."""
        return max(0.0, self._back_at - time.monotonic()) if self._last_deadline_ms > 0 else 0.0

    def refused_unread(self, retry_after_ms: int) -> float:
        """A call that came back early is refused without being read: held as in
        :meth:`refused`, within the deadline the caller's last call carried."""
        self._early = True
        return self.refused(retry_after_ms, Deadline.after_ms(self._last_deadline_ms))

    def answered(self) -> None:
        """The call was admitted and answered: nothing to pace."""
        self._back_at = 0.0

    def refused(self, retry_after_ms: int, deadline: Deadline) -> float:
        """The call is refused: how long to hold its answer, in seconds from now.

        0 for a caller that honours ``retry_after_ms``. The pause this caller is told
        counts from the end of the hold.
        """
        held_s = 0.0
        if self._early:
            # Jittered: callers refused together would otherwise come back together, for ever.
            held_s = max(0.0, random.uniform(_JITTER, 1.0) * min(
                retry_after_ms / 1000.0, deadline.remaining_s() * _DEADLINE_SHARE - _REPLY_MARGIN_S))
        self._back_at = time.monotonic() + held_s + _EARLY_SHARE * retry_after_ms / 1000.0
        self._hold_s = held_s
        return held_s

    def take_hold(self) -> float:
        """Seconds to hold the reply to the call just served, counted from now (0 unless
        :meth:`refused` decided a hold); asking again returns 0."""
        held_s, self._hold_s = self._hold_s, 0.0
        return held_s
