"""Pacing: one connection's refusals, and whether its caller came back before the pause
it was told.

A Thrift connection is strictly request-reply, so a connection refused and called again
before ``retry_after_ms`` is a caller ignoring it; its next refusal is held (see
:mod:`service.overload.gate`, which decides, and :mod:`service.overload.held_connections`,
which holds). Callers that honour ``retry_after_ms`` (with the usual x0.5 to x1.5
jitter) are never held.
"""

from __future__ import annotations

import random
from contextvars import ContextVar

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.overload.brownout import Criticality
from service.overload.fair_share import CallerState

__all__ = ["ConnectionPacing", "current_connection"]

#: A caller who comes back before this share of the pause it was told has ignored it
#: (callers jitter their pause by x0.5 to x1.5; the rest is slack for the network).
_EARLY_SHARE = 0.4
#: A held refusal is answered within this share of the remaining deadline...
_DEADLINE_SHARE = 0.95
#: ...and at least this much before it, so that the reply reaches the caller in time.
_REPLY_MARGIN_S = 0.05
#: A hold lasts between this share of its longest and the whole of it. Every caller is
#: answered within its deadline, so callers/deadline answers a second is the floor that
#: pacing can bring refusals down to: the longer the holds, the closer (the manual's
#: Performance page gives the rate ``make bench`` measures).
_JITTER = 0.9

#: The connection of the call being served; set by the server per call.
current_connection: ContextVar[ConnectionPacing | None] = ContextVar(
    "fanout_connection", default=None
)


class ConnectionPacing:
    """One connection's refusals: when it was told to come back, and whether it did."""

    __slots__ = (
        "_back_at",
        "_clock",
        "_early",
        "_last_deadline_ms",
        "_hold_s",
        "criticality",
        "identity",
        "caller",
    )

    def __init__(self, clock: Clock = SYSTEM_CLOCK, identity: str = "") -> None:
        self._clock = clock
        #: The name of the connection's client certificate (mutual TLS), or "".
        self.identity = identity
        #: The caller of this connection's last call read (for a call refused unread).
        self.caller: CallerState | None = None
        self._back_at = 0.0
        self._early = False
        #: The criticality of this caller's last call read, for a call refused unread.
        self.criticality = Criticality.CRITICAL
        self._last_deadline_ms = 0.0  # the deadline of this caller's last call read in full
        self._hold_s = 0.0  # how long to hold the reply to the call being served

    def arrived(self, deadline: Deadline, criticality: Criticality = Criticality.CRITICAL) -> None:
        """A call from this caller arrived now (before its admission is decided)."""
        self._early = self._clock.monotonic() < self._back_at
        self._last_deadline_ms = deadline.remaining_ms()
        self.criticality = criticality

    def back_early(self) -> bool:
        """True if a call arriving now comes before the pause this caller was told."""
        return self._last_deadline_ms > 0 and self._clock.monotonic() < self._back_at

    def early_for_s(self) -> float:
        """Seconds from now until a call from this caller no longer counts as early (0 if none)."""
        return (
            max(0.0, self._back_at - self._clock.monotonic()) if self._last_deadline_ms > 0 else 0.0
        )

    def refused_unread(self, retry_after_ms: int) -> float:
        """A call that came back early is refused without being read: held as in
        :meth:`refused`, within the deadline the caller's last call carried."""
        self._early = True
        return self.refused(retry_after_ms, Deadline.after_ms(self._last_deadline_ms, self._clock))

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
            held_s = max(
                0.0,
                random.uniform(_JITTER, 1.0)
                * min(
                    retry_after_ms / 1000.0,
                    deadline.remaining_s() * _DEADLINE_SHARE - _REPLY_MARGIN_S,
                ),
            )
        self._back_at = self._clock.monotonic() + held_s + _EARLY_SHARE * retry_after_ms / 1000.0
        self._hold_s = held_s
        return held_s

    def take_hold(self) -> float:
        """Seconds to hold the reply to the call just served, counted from now (0 unless
        :meth:`refused` decided a hold); asking again returns 0."""
        held_s, self._hold_s = self._hold_s, 0.0
        return held_s
