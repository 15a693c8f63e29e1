"""A circuit breaker per backend: stop calling what keeps failing, one trial call at a time
until it heals.

States, and what moves between them::

    CLOSED --(consecutive failures, or failure rate over the window)--> OPEN
    OPEN --(open_ms passed)--> HALF_OPEN: one trial call at a time may go through
    HALF_OPEN --(trial succeeds)--> CLOSED        --(trial fails)--> OPEN again
    OPEN or HALF_OPEN --(open_ms passed, and a health check passes)--> CLOSED

While OPEN, :meth:`CircuitBreaker.check` raises :class:`~lookups.errors.CircuitOpen`
at once: the panel fails fast (``ERROR``, retryable) and its call does not wait out
a dead backend's timeout. An outage is logged twice: WARNING when the circuit opens
(``closed -> open``), INFO when it closes again, with how long it was open and how many
trial calls failed meanwhile. Its trial calls and their failures, a few a second
during an outage, are DEBUG lines only.

What counts as a failure is the backend's: unreachable, timed out, or HTTP 5xx
(``BackendUnavailable`` and ``BackendTimeout``). A bad answer (4xx, wrong JSON) is
the backend working, and so is a refusal by the breaker itself.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.errors import CircuitOpen

__all__ = ["BreakerPolicy", "CircuitBreaker", "CircuitState"]

log = logging.getLogger(__name__)


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    """When a breaker opens, and for how long."""

    consecutive_failures: int = 5  # this many failures in a row open it
    failure_rate: float = 0.5  # ...or more than this share of the calls in the window
    window_s: float = 10.0
    min_calls: int = 20  # the rate counts once the window holds this many
    open_ms: int = 2000  # how long it stays open before a trial call


class CircuitBreaker:
    """The breaker of one backend (``name``: the backend's, ``mongo``, ``alerts``, ...)."""

    def __init__(
        self, name: str, policy: BreakerPolicy = BreakerPolicy(), clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.name = name
        self._clock = clock
        self.policy = policy
        self.state = CircuitState.CLOSED
        self.opened = 0  # times it has opened
        self._consecutive = 0
        self._recent: deque[tuple[float, bool]] = deque()  # (when, failed) within the window
        self._failures_in_window = 0
        self._open_until = 0.0
        self._trying = False
        self._outage_since = 0.0  # when it last opened from closed
        self._failed_trials = 0  # trial calls failed since

    def check(self) -> bool:
        """Before a call: raise :class:`CircuitOpen` if it may not go; True for the trial call."""
        if self.state is CircuitState.CLOSED:
            return False
        now = self._clock.monotonic()
        if self.state is CircuitState.OPEN and now >= self._open_until:
            self._move(CircuitState.HALF_OPEN)
        if self.state is CircuitState.HALF_OPEN and not self._trying:
            self._trying = True
            return True
        raise CircuitOpen(
            f"{self.name}: circuit open after repeated failures; failing fast", retry_safe=False
        )

    def record(self, failed: bool, trial: bool = False) -> None:
        """After a call that :meth:`check` let through: did the backend fail it?"""
        if trial:
            self._trying = False
            if failed:
                self._open()
            else:
                self._close()
            return
        if self.state is not CircuitState.CLOSED:
            return  # an answer to a call started before the circuit opened
        now = self._clock.monotonic()
        self._remember(now, failed)
        self._consecutive = self._consecutive + 1 if failed else 0
        policy = self.policy
        if self._consecutive >= policy.consecutive_failures or (
            len(self._recent) >= policy.min_calls
            and self._failures_in_window > policy.failure_rate * len(self._recent)
        ):
            self._open()

    def checked_healthy(self) -> None:
        """A health check of the backend passed. Once the open period is over, that is a
        successful trial and the circuit closes: an idle server's circuit does not wait for
        a call to find the backend back. Before then, or with a trial call in flight,
        nothing changes (a backend may answer pings and still fail lookups)."""
        if self.state is CircuitState.CLOSED or self._trying:
            return
        if self._clock.monotonic() >= self._open_until:
            self._close()

    def _remember(self, now: float, failed: bool) -> None:
        recent, horizon = self._recent, now - self.policy.window_s
        recent.append((now, failed))
        self._failures_in_window += failed
        while recent and recent[0][0] < horizon:
            self._failures_in_window -= recent.popleft()[1]

    def _open(self) -> None:
        self._open_until = self._clock.monotonic() + self.policy.open_ms / 1000.0
        self.opened += 1
        self._move(CircuitState.OPEN)

    def _close(self) -> None:
        self._consecutive = 0
        self._recent.clear()
        self._failures_in_window = 0
        self._move(CircuitState.CLOSED)

    def _move(self, state: CircuitState) -> None:
        if state is self.state:
            return
        previous, self.state = self.state, state
        if previous is CircuitState.CLOSED:  # an outage begins
            self._outage_since, self._failed_trials = self._clock.monotonic(), 0
            log.warning(
                "circuit %s: closed -> open for %d ms (failing fast)",
                self.name,
                self.policy.open_ms,
            )
        elif state is CircuitState.CLOSED:  # and ends
            log.info(
                "circuit %s: %s -> closed after %.1f s, %d trial calls failed",
                self.name,
                previous.value,
                self._clock.monotonic() - self._outage_since,
                self._failed_trials,
            )
        else:  # the probing within an outage
            self._failed_trials += state is CircuitState.OPEN
            log.debug("circuit %s: %s -> %s", self.name, previous.value, state.value)

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.name} {self.state.value}>"
