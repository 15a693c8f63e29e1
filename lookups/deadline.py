"""A point in monotonic time by which work must be done: the one time value a call carries.

The handler makes a call's :class:`Deadline` on the service's clock; it goes down through
the engine, each lookup (:meth:`lookups.base.Lookup.fetch`), its backend (``Backend.call``),
the guard and the executors, and turns into seconds only where a library takes seconds
(pymongo's ``timeout()``, requests' ``timeout=``, a semaphore's wait). What it passes
through reads the time from :attr:`Deadline.clock`, so one clock measures a whole call.
It also says whose call it is (:attr:`Deadline.flow`, :mod:`lookups.flow`): the place the
call's tasks take in the backends' lines, which the service sets when it admits the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lookups.clock import SYSTEM_CLOCK, Clock, Waitable
from lookups.flow import NO_FLOW, Flow

__all__ = ["Deadline"]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on a monotonic clock (:mod:`lookups.clock`).

    Immutable and cheap: pass it down instead of passing "seconds left", which
    goes stale the moment it is computed.
    """

    at: float  # seconds on clock.monotonic()
    clock: Clock = field(default=SYSTEM_CLOCK, compare=False, repr=False)
    #: Whose call it bounds: its tasks' place in the backends' lines.
    flow: Flow = field(default=NO_FLOW, compare=False, repr=False)

    @classmethod
    def after_ms(cls, ms: float, clock: Clock = SYSTEM_CLOCK) -> Deadline:
        """``ms`` milliseconds from now on ``clock``."""
        return cls(clock.monotonic() + ms / 1000.0, clock)

    @classmethod
    def after_s(cls, seconds: float, clock: Clock = SYSTEM_CLOCK) -> Deadline:
        """``seconds`` from now on ``clock``."""
        return cls(clock.monotonic() + seconds, clock)

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - self.clock.monotonic())

    def remaining_ms(self) -> float:
        return self.remaining_s() * 1000.0

    @property
    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at

    def earlier(self, ms: float) -> Deadline:
        """This deadline or ``ms`` milliseconds from now, whichever comes first (the same
        call's)."""
        return Deadline(min(self.at, self.clock.monotonic() + ms / 1000.0), self.clock, self.flow)

    def for_flow(self, flow: Flow) -> Deadline:
        """The same deadline, for the call whose place in the backends' lines is ``flow``."""
        return Deadline(self.at, self.clock, flow)

    def wait(self, event: Waitable) -> bool:
        """Wait for ``event`` until this deadline; True if it was set by then."""
        return self.clock.wait(event, self.at)

    def now(self) -> float:
        """The time on this deadline's clock: where a call measures its intervals."""
        return self.clock.monotonic()
