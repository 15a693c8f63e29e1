"""The CPU rule of admission's limit: enough calls in flight to keep the core busy, no more.

Latency alone lets a CPU-bound process take too much: the long-term average follows
the queueing up, so the limit grows until latency meets the ceiling, and every call
beyond those that keep the core busy only waits and makes each call dearer (the
manual's Performance page gives the figures). So the event loop's demand for a core is measured too
(``/proc/self/schedstat``, over windows of a quarter of a second), with the calls' mean
latency over the same window. While the loop wants a core ``cpu_saturated`` of the
time, the limit moves one step a window (a tenth), none in between, by how long calls
queue for the core, as TCP Vegas keeps a path's queue:

* it falls while calls take more than 2.2 times the least latency;
* it grows while they take less than 1.6 times (and the limit is in demand);
* between, it holds: a queue for the core about as long as the rest of a call.

**While callers contend** (one over its share, another within its own:
:meth:`~service.overload.fair_share.FairShare.contended`), the queue is held
shorter: the limit falls past 1.3 times the least and grows below 1.1 times. The calls of
a caller within its share wait for the core in the same queue as the storm's, so the
queue's length is their latency; a shorter one costs the callers over their share a
little of their throughput (the manual's Performance page gives the figures). Whether
callers contend is looked at each window, not held for longer.

One step a window, because the measure is a window old: a step at every update would
swing the limit on one stale measure. Not down to the core's bare need: below about
twice the least latency the loop is still saturated but wakes for fewer events at a
time, so each call costs it more. Close to saturated (``_NEAR`` of it), a window with a
moment to spare grows the limit one step too, not at every update, so that a pause of
the callers does not take it up several steps at once.

**The least latency, learnt in a lull** (:class:`LeastLatency`). Learnt from ordinary
calls, that least is only as low as the limit lets it be: on a saturated loop every call
queues for the core, so a least learnt at some limit would hold that limit, whatever
the core could do.

So while the rule is in force, the least is learnt afresh in a lull, as BBR's ProbeRTT
drains a path every 10 s to learn its round-trip time without its own queue: once an
epoch (10 s), admission lets no more than :data:`LULL_CALLS` calls be in flight until
that many calls started under the lull have ended. Those calls meet no queue but each
other, and their latency is the call's own: its backends and its own share of the core,
whatever the limit was. The lull lasts about two calls' time (the calls in flight
drain, then the lull's own run); the waiting line keeps its length and its order
meanwhile, and admission's limit does not move until the loop has been measured again
after it (the loop's spare moments during a lull are not room to grow).

The least is the least of this epoch and the last: a least from a backend that has
since slowed is forgotten within 20 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lookups.clock import Clock

__all__ = ["CpuRule", "LeastLatency", "LULL_CALLS"]

_WINDOW_S = 0.25  # the loop's demand for a core is measured over windows this long
_STEP = 0.9  # the limit's step down per window (and 1 / _STEP up)
_QUEUE_HIGH = 2.2  # it falls while calls take longer than this many times the least,
_QUEUE_LOW = 1.6  # ...and grows while they take less than this many times
_CONTENDED_QUEUE = (1.3, 1.1)  # the two, while callers contend
_NEAR = 0.9  # a loop this share of saturated, or more, grows one step a window
EPOCH_S = 10.0  # the least is the least of this epoch and the last; a lull an epoch
LULL_CALLS = 4  # calls in flight during a lull, and calls it waits for
_LULL_LONGEST_S = 1.0  # a lull whose calls do not end (none came) gives up after this


class CpuRule:
    """The loop's windows, the least latency, and the limit's step for the CPU.

    ``clock`` is the service's and ``cpu_demand`` the seconds the loop's thread ran
    or waited for a core, so far; ``saturated_share`` is ``admission.cpu_saturated``
    (0: the rule is off).
    """

    def __init__(
        self, clock: Clock, cpu_demand: Callable[[], float], saturated_share: float
    ) -> None:
        self._clock = clock
        self._cpu_demand = cpu_demand
        self._share = saturated_share
        self.least = LeastLatency(clock)
        self.busy = 0.0  # the loop's demand for a core over the last window
        self.window_latency_s = 0.0  # the calls' mean latency over the last window
        self._start_window(clock.monotonic(), cpu_demand())
        self._measured = False  # the last window ended at the last measure

    def call_ended(self, latency_s: float) -> None:
        """An admitted call ended after ``latency_s``: the least, and the window's mean."""
        if self.least.sample(latency_s):
            # The lull ended: the loop had moments to spare during it, which are no room
            # to grow. The window before it stands until one after it is measured.
            self._start_window(self._clock.monotonic(), self._cpu_demand())
            self._measured = False
        self._latency_sum_s += latency_s
        self._calls += 1

    def saturated(self) -> bool:
        """Whether the loop wanted a core ``saturated_share`` of the last window, or more
        (measuring a new window if one has passed)."""
        if self._share <= 0:
            return False
        started, demand_at = self._window
        now = self._clock.monotonic()
        self._measured = now - started >= _WINDOW_S
        if self._measured:
            demand = self._cpu_demand()
            self.busy = (demand - demand_at) / (now - started)
            if self._calls:
                self.window_latency_s = self._latency_sum_s / self._calls
            self._start_window(now, demand)
            self.least.roll()
        return self.busy >= self._share

    def _start_window(self, now: float, demand: float) -> None:
        """A new window from ``now`` (the loop's demand so far ``demand``), its calls none yet."""
        self._window = (now, demand)
        self._latency_sum_s, self._calls = 0.0, 0

    def saturated_step(self, demand: bool, contended: Callable[[], bool] | None = None) -> float:
        """On a saturated loop: the factor for the limit (1: hold), a shorter queue held
        while ``contended()`` (asked once a window). Starts a lull to learn the least latency
        once an epoch."""
        if not self._measured:
            return 1.0
        self.least.start_lull()
        shorter = contended is not None and contended()
        high, low = _CONTENDED_QUEUE if shorter else (_QUEUE_HIGH, _QUEUE_LOW)
        queue = self.window_latency_s / max(self.least.seconds, 1e-6)
        if queue > high:
            return _STEP
        return 1.0 / _STEP if queue < low and demand else 1.0

    def near(self) -> bool:
        """Whether the loop, not saturated, was close to it over the last window."""
        return self._share > 0 and self.busy >= _NEAR * self._share

    def near_step(self, may_grow: bool) -> float:
        """Close to saturated: one step up per window measured, if the limit may grow."""
        return 1.0 / _STEP if self._measured and may_grow else 1.0


class LeastLatency:
    """The least latency of the last one or two epochs, and the lull state.

    ``sample(latency_s)`` takes every admitted call's latency; ``start_lull()`` starts a
    lull if none ran this epoch; ``cap(limit)`` is how many calls may be in flight now.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._epochs = [math.inf, math.inf]  # the least: last epoch, this one
        self._epoch_since = clock.monotonic()
        self._lull_since: float | None = None  # while a lull runs: when it began
        self._lull_open: float | None = None  # ...when it admitted its first call
        self._lull_ended = 0  # calls started under it that ended
        self._last_lull = -math.inf
        self.lulls = 0

    @property
    def seconds(self) -> float:
        """The least latency of this epoch and the last (``inf`` before any call)."""
        return min(self._epochs)

    @property
    def lulling(self) -> bool:
        return self._lull_since is not None

    def cap(self, limit: float) -> int:
        """Calls that may be in flight: the limit, or :data:`LULL_CALLS` during a lull."""
        return min(LULL_CALLS, int(limit)) if self._lull_since is not None else int(limit)

    def sample(self, latency_s: float) -> bool:
        """A call ended after ``latency_s``; True when it ended a lull."""
        if latency_s < self._epochs[1]:
            self._epochs[1] = latency_s
        if self._lull_since is None:
            return False
        now = self._clock.monotonic()
        if self._lull_open is not None and now - latency_s >= self._lull_open:
            self._lull_ended += 1  # it started under the lull
        if self._lull_ended >= LULL_CALLS or now - self._lull_since >= _LULL_LONGEST_S:
            self._lull_since = None
            return True
        return False

    def admitted(self) -> None:
        """A call was admitted. The first one admitted during a lull opens it: calls that
        started since ran with no more than :data:`LULL_CALLS` in flight (calls admitted
        before the lull, whose greenlets had yet to run, did not)."""
        if self._lull_since is not None and self._lull_open is None:
            self._lull_open = self._clock.monotonic()

    def start_lull(self) -> bool:
        """Begin a lull unless one ran this epoch (or runs); True if one began."""
        now = self._clock.monotonic()
        if self._lull_since is not None or now - self._last_lull < EPOCH_S:
            return False
        self._lull_since, self._lull_open, self._lull_ended = now, None, 0
        self._last_lull = now
        self.lulls += 1
        return True

    def roll(self) -> None:
        """Start a new epoch once the current one is :data:`EPOCH_S` old."""
        now = self._clock.monotonic()
        if now - self._epoch_since >= EPOCH_S:
            self._epochs, self._epoch_since = [self._epochs[1], math.inf], now
