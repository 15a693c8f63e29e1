"""A point in monotonic time by which work must be done."""

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
    def after_ms(cls, budget_ms: float) -> "Deadline":
        return cls(time.monotonic() + budget_ms / 1000.0)

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self) -> float:
        return self.remaining_s() * 1000.0

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def earlier(self, budget_ms: float) -> "Deadline":
        """This deadline or ``budget_ms`` from now, whichever comes first."""
        return Deadline(min(self.at, time.monotonic() + budget_ms / 1000.0))
