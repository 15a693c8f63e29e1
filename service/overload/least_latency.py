"""The least latency of a call that met no queue for the core, and the probe that learns it.

Admission's CPU rule (:mod:`service.overload.cpu_rule`) holds its limit while calls
take about twice the least latency. Learnt from ordinary calls, that least is only as
low as the limit lets it be: on a saturated loop every call queues for the core, so a
least learnt at a limit of 30 held a limit of 30, and one learnt at 20 held 20. Which of
the two a server kept depended on how its overload began (the README gives the runs).

So while the rule is in force, the least is learnt afresh by a probe, as BBR's ProbeRTT
drains a path every 10 s to learn its round-trip time without its own queue: once an
epoch (10 s), admission lets no more than :data:`PROBE_CALLS` calls be in flight until
that many calls started under the probe have ended. Those calls meet no queue but each
other, and their latency is the call's own: its backends and its own share of the core,
whatever the limit was. The probe lasts about two calls' time (the calls in flight
drain, then the probe's own run); the waiting line keeps its length and its order
meanwhile, and admission's limit does not move until the loop has been measured again
after it (the loop's spare moments during a probe are not room to grow).

The least is the least of this epoch and the last: a least from a backend that has
since slowed is forgotten within 20 s.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

__all__ = ["LeastLatency", "PROBE_CALLS"]

EPOCH_S = 10.0        # the least is the least of this epoch and the last; one probe an epoch
PROBE_CALLS = 4       # calls in flight during a probe, and calls it waits for
_PROBE_LONGEST_S = 1.0  # a probe whose calls do not end (none came) gives up after this


class LeastLatency:
    """The least latency of the last one or two epochs, and the probe state.

    ``sample(latency_s)`` takes every admitted call's latency; ``start_probe()`` starts a
    probe if none ran this epoch; ``cap(limit)`` is how many calls may be in flight now.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._epochs = [math.inf, math.inf]   # the least: last epoch, this one
        self._epoch_since = clock()
        self._probe_since: Optional[float] = None   # while a probe runs: when it began
        self._probe_open: Optional[float] = None    # ...when it admitted its first call
        self._probe_ended = 0                       # calls started under it that ended
        self._last_probe = -math.inf
        self.probes = 0

    @property
    def seconds(self) -> float:
        """The least latency of this epoch and the last (``inf`` before any call)."""
        return min(self._epochs)

    @property
    def probing(self) -> bool:
        return self._probe_since is not None

    def cap(self, limit: float) -> int:
        """Calls that may be in flight: the limit, or :data:`PROBE_CALLS` during a probe."""
        return min(PROBE_CALLS, int(limit)) if self._probe_since is not None else int(limit)

    def sample(self, latency_s: float) -> bool:
        """A call ended after ``latency_s``; True when it ended a probe."""
        if latency_s < self._epochs[1]:
            self._epochs[1] = latency_s
        if self._probe_since is None:
            return False
        now = self._clock()
        if self._probe_open is not None and now - latency_s >= self._probe_open:
            self._probe_ended += 1   # it started under the probe
        if self._probe_ended >= PROBE_CALLS or now - self._probe_since >= _PROBE_LONGEST_S:
            self._probe_since = None
            return True
        return False

    def admitted(self) -> None:
        """A call was admitted. The first one admitted during a probe opens it: calls that
        started since ran with no more than :data:`PROBE_CALLS` in flight (calls admitted
        before the probe, whose greenlets had yet to run, did not)."""
        if self._probe_since is not None and self._probe_open is None:
            self._probe_open = self._clock()

    def start_probe(self) -> bool:
        """Begin a probe unless one ran this epoch (or runs); True if one began."""
        now = self._clock()
        if self._probe_since is not None or now - self._last_probe < EPOCH_S:
            return False
        self._probe_since, self._probe_open, self._probe_ended = now, None, 0
        self._last_probe = now
        self.probes += 1
        return True

    def roll(self) -> None:
        """Start a new epoch once the current one is :data:`EPOCH_S` old."""
        now = self._clock()
        if now - self._epoch_since >= EPOCH_S:
            self._epochs, self._epoch_since = [self._epochs[1], math.inf], now
