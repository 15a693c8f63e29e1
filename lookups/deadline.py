"""A point in monotonic time by which work must be done: the one time value a call carries.

The handler makes a call's :class:`Deadline`; it goes down through the engine, each
lookup (:meth:`lookups.base.Lookup.fetch`), its backend (``Backend.call``), the guard
and the executors, and turns into seconds only where a library takes seconds
(pymongo's ``timeout()``, requests' ``timeout=``, a semaphore's wait).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Deadline"]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on the monotonic clock.

    Immutable and cheap: pass it down instead of passing "seconds left", which
    goes stale the moment it is computed.
    """

    at: float  # time.monotonic() seconds

    @classmethod
    def after_ms(cls, ms: float) -> "Deadline":
        """``ms`` milliseconds from now."""
        return cls(time.monotonic() + ms / 1000.0)

    @classmethod
    def after_s(cls, seconds: float) -> "Deadline":
        """``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self) -> float:
        return self.remaining_s() * 1000.0

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def earlier(self, ms: float) -> "Deadline":
        """This deadline or ``ms`` milliseconds from now, whichever comes first."""
        return Deadline(min(self.at, time.monotonic() + ms / 1000.0))
