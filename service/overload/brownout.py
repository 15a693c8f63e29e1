"""Brownout: under overload, lighter answers for the least critical calls before refusals.

Each call carries a :class:`Criticality` (the caller's ``RequestMeta.criticality``;
none means ``CRITICAL``), and each panel is essential or optional (``[lookups.<name>]
optional``). The :class:`Dimmer`'s level, from 0 (nothing shed) to 1, climbs a ladder
of five rungs, each a fifth of the range; within a rung, the share of the calls it
names that are shed grows with the level, and a rung starts only once the one below
it is whole:

    1. optional panels of SHEDDABLE calls are not run
    2. SHEDDABLE calls are refused (``Overloaded``)
    3. optional panels of SHEDDABLE_PLUS and CRITICAL calls are not run
    4. SHEDDABLE_PLUS calls are refused
    5. optional panels of CRITICAL_PLUS calls are not run

The dimmer refuses no CRITICAL or CRITICAL_PLUS call: when even their essential
panels are too much, admission refuses, and its queue serves and keeps the more
critical first (:mod:`service.overload.admission`), so CRITICAL_PLUS is refused last.
A panel not run is ``SKIPPED`` with ``error_type`` "Brownout" and ``retryable`` true;
it takes no slot and makes no backend call. Within a rung the calls shed are spread
evenly (an accumulator per rung, not a coin), so a share is exact over a few calls.

**The controller** (:meth:`Dimmer.update`, every :data:`WINDOW_S` on a timer of the
hub, never on a call). Klein et al.'s brownout controller sets the dimmer to hold
response time at a setpoint; admission already holds latency under its own target by
its limit, and tells when that is no longer enough: it refuses. So the dimmer follows
admission's refusals (not the refusals of callers back too early, which pacing makes
and which say nothing new; not its own): a window with one goes a step up; the level
comes down a step only after :data:`COOL_WINDOWS` windows in a row with no refusal
and no standing queue, and holds in between. Up at once, down slowly, and a band in
which it holds: this is the hysteresis that keeps it from flapping at a steady load,
where it settles at the share that keeps admission just short of refusing. At a load
that stays past capacity each step down is a test that admission answers with
refusals, of CRITICAL calls too: a step down that brings a refusal back within
:data:`PROBATION_WINDOWS` doubles the cool stretch before the next one (up to
``2 ** BACKOFF_MAX`` times), and its level is not stepped down to again for
:data:`AVOID_S` (doubled likewise): the climb after it overshoots (the calls admitted
below are still in flight), and without the memory the way back down would end on
the same refusals. A step that holds restores the base pace, so the dimmer tries
a step down less and less often at a steady overload and still comes down at its pace once the
load falls. Refusals come late where the bound is a pool: the optional panels a step
down lets in fill the pools, latency rises, admission cuts its limit for seconds, and
only then refuses. So a round of cuts on latency (:attr:`AdmissionStats.latency_cuts`,
the gradient's signal, not the CPU's) holds the level like a standing queue, and one
within a step down's probation fails it as a refusal would, before any refusal. And once
the level is up (or held up by ``brownout_min_level``), a backend pool short of slots
(its takers waited, and Little's law wants more than it has: ``limited_by`` "slots" in
`fanout pools`) counts as a refusal: each optional panel run there takes a slot an
essential one waits for, and admission cannot tell those levels apart (the level settled
anywhere among them). It never starts a climb: a load admission carries without refusing
is served whole, however full its pools. The level never climbs past the top of the
highest rung that names a criticality seen in the last two seconds (with only CRITICAL
callers 0.6 sheds all there is to shed; higher would only slow the way back). A latency
setpoint of its own would fight admission's limit (both would act on one signal);
queueing alone is no overload (a closed loop of callers at capacity always queues, and
is served whole). ``brownout_min_level`` keeps the level up by hand (an expected peak).

**It lets go when the load does.** A window in which admission had room to spare (no
call waited, and no more than half its limit was ever in flight: ``spare``), with no
refusal, no cut and no backend pool short of slots, takes the level straight down to
its floor: nothing is left to shed for, and stepping down a cool stretch at a time
would answer the calls after a storm lighter for seconds on an idle server.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import gevent
import gevent.event
from gevent import Greenlet

from lookups.clock import SYSTEM_CLOCK, Clock
from tracing.context import spawn_in_context
from tracing.pools import WINDOW_S as POOLS_WINDOW_S

__all__ = [
    "Criticality",
    "Dimmer",
    "DimmerStats",
    "BrownoutVerdict",
    "WINDOW_S",
    "STEP",
    "COOL_WINDOWS",
    "BACKOFF_MAX",
    "PROBATION_WINDOWS",
    "AVOID_S",
    "REFUSED_FROM",
]

log = logging.getLogger(__name__)

#: How often the controller looks at admission, in seconds.
WINDOW_S = 0.25
#: How far the level moves in one window; a rung is four steps.
STEP = 0.05
#: What :meth:`Dimmer.recent` looks back over: the pools' window, as `fanout pools` reports.
REPORT_WINDOW_S = POOLS_WINDOW_S
#: How many windows the ceiling remembers the criticalities that arrived (two seconds).
_PRESENT_WINDOWS = 8
#: Windows in a row without a refusal or a standing queue before the level comes down.
COOL_WINDOWS = 8
#: Doublings of the cool stretch after steps down that brought refusals back (at most 8x).
BACKOFF_MAX = 3
#: Cool windows after a step down within which a refusal counts against it (8 s): calls
#: that wait on pools admitted at the lower level push admission to refuse seconds later.
PROBATION_WINDOWS = 4 * COOL_WINDOWS
#: Seconds the level of such a step is not stepped down to again; doubled with the cool
#: stretch (up to 60 s).
AVOID_S = 15
_RUNG = 0.2


class Criticality(enum.IntEnum):
    """How much a call matters under overload; lower sorts first (more critical)."""

    CRITICAL_PLUS = 0
    CRITICAL = 1
    SHEDDABLE_PLUS = 2
    SHEDDABLE = 3


_C = Criticality
#: The ladder, lowest rung first: (refuse the call?, the criticalities it names).
_LADDER: tuple[tuple[bool, frozenset[Criticality]], ...] = (
    (False, frozenset({_C.SHEDDABLE})),
    (True, frozenset({_C.SHEDDABLE})),
    (False, frozenset({_C.SHEDDABLE_PLUS, _C.CRITICAL})),
    (True, frozenset({_C.SHEDDABLE_PLUS})),
    (False, frozenset({_C.CRITICAL_PLUS})),
)


def _rung_tops(criticality: Criticality, refusing: bool = False) -> list[float]:
    """The levels at which the rungs naming ``criticality`` are whole (with ``refusing``,
    only the rungs that refuse)."""
    return [
        round((rung + 1) * _RUNG, 6)
        for rung, (refuse, names) in enumerate(_LADDER)
        if criticality in names and (refuse or not refusing)
    ]


#: Per criticality, the top of the highest rung that names it.
_TOP = [max(_rung_tops(c)) for c in Criticality]
#: Per criticality, the level from which the dimmer refuses every call of it (none: never).
REFUSED_FROM = [min(_rung_tops(c, refusing=True), default=2.0) for c in Criticality]


class BrownoutVerdict(enum.Enum):
    """What the dimmer does to one call."""

    WHOLE = "whole"  # run every panel asked for
    LIGHTER = "lighter"  # run the essential panels only
    REFUSED = "refused"  # answer Overloaded


@dataclass
class DimmerStats:
    """Counters since start; by criticality name."""

    lighter: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    steps: int = 0  # level changes


class Dimmer:
    """The brownout dimmer of one server: its level, its ladder and its controller.

    ``refusals`` and ``queue_standing`` read admission's state (refusals so far that
    admission decided itself; whether its queue has stood longer than its interval);
    ``pools_short`` tells whether a backend pool is short of slots; ``spare`` whether
    admission had room to spare since it was last asked; ``pressure`` is set
    at each refusal or cut admission makes (the dimmer sleeps on it while at rest);
    ``clock`` is the service's. Tests drive :meth:`update` with their own clock.
    """

    def __init__(
        self,
        refusals: Callable[[], int],
        queue_standing: Callable[[], bool],
        *,
        latency_cuts: Callable[[], int] | None = None,
        pressure: gevent.event.Event | None = None,
        pools_short: Callable[[], bool] = lambda: False,
        spare: Callable[[], bool] = lambda: False,
        enabled: bool = True,
        min_level: float = 0.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.enabled = enabled
        self.min_level = min_level if enabled else 0.0
        self.level = self.min_level
        self.stats = DimmerStats()
        self._refusals = refusals
        self._queue_standing = queue_standing
        self._pools_short = pools_short
        self._spare = spare
        self._clock = clock
        self._seen_refusals = refusals()
        self._latency_cuts = latency_cuts or (lambda: 0)
        self._seen_cuts = self._latency_cuts()
        self._pressure = pressure
        self._cool = 0
        self._backoff = 0  # doublings of the cool stretch
        self._probation: int | None = None  # windows since a step down not yet held
        self._avoid = (-1.0, 0.0)  # a level that failed, and until when to avoid it
        self._owed = [0.0] * len(_LADDER)  # each rung's share accumulated, not yet acted on
        #: Calls that reached the gate since the last update, by criticality (the gate counts).
        self.arrivals = [0] * len(Criticality)
        self._present: deque[float] = deque(maxlen=_PRESENT_WINDOWS)  # each window's ceiling
        # Per window: (time, highest level, calls answered lighter so far, refused so far).
        self._windows: deque[tuple[float, float, int, int]] = deque()
        self._loop: Greenlet | None = None

    def start(self) -> None:
        """Run :meth:`update` every :data:`WINDOW_S` in a greenlet of its own, until
        :meth:`stop`; at rest, only once ``pressure`` is set."""
        if self.enabled and self._loop is None:
            self._loop = spawn_in_context(self._run)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.kill(block=False)
            self._loop = None

    def _run(self) -> None:
        while True:
            if self._pressure is not None and self._resting():
                # Cleared, then looked at again, with no switch between: a refusal after the
                # look sets it, so none is missed. An idle server's dimmer costs nothing.
                self._pressure.clear()
                if self._resting():
                    self._pressure.wait()
            self._clock.sleep(WINDOW_S)
            self.update()

    def _at_rest(self) -> bool:
        """At level 0 with no floor and no step down on probation: it can go no lower."""
        return self.level <= 0.0 and self.min_level <= 0.0 and self._probation is None

    def _resting(self) -> bool:
        """At rest with nothing new to push it up: :meth:`update` would do nothing."""
        return (
            self._at_rest()
            and self._refusals() <= self._seen_refusals
            and self._latency_cuts() <= self._seen_cuts
        )

    def decide(self, criticality: Criticality) -> BrownoutVerdict:
        """The verdict for one call of ``criticality`` at the current level (counted)."""
        if self.level <= 0.0:
            return BrownoutVerdict.WHOLE
        verdict = BrownoutVerdict.WHOLE
        for rung, (refuse, names) in enumerate(_LADDER):
            if criticality not in names:
                continue
            share = round(min(1.0, max(0.0, (self.level - rung * _RUNG) / _RUNG)), 6)
            if share <= 0.0 or not self._take(rung, share):
                continue
            verdict = BrownoutVerdict.REFUSED if refuse else BrownoutVerdict.LIGHTER
            if refuse:
                break
        if verdict is not BrownoutVerdict.WHOLE:
            counts = (
                self.stats.refused if verdict is BrownoutVerdict.REFUSED else self.stats.lighter
            )
            counts[criticality.name] = counts.get(criticality.name, 0) + 1
        return verdict

    def _take(self, rung: int, share: float) -> bool:
        """Whether this call is one of the ``share`` the rung sheds: evenly, not by chance."""
        owed = self._owed[rung] + share
        if owed >= 1.0:
            self._owed[rung] = owed - 1.0
            return True
        self._owed[rung] = owed
        return False

    def update(self) -> None:
        """One controller step: up on admission's refusals, down after a cool stretch."""
        refusals = self._refusals()
        refused, self._seen_refusals = refusals > self._seen_refusals, refusals
        cuts = self._latency_cuts()
        cut, self._seen_cuts = cuts > self._seen_cuts, cuts
        if not self.enabled:
            return
        spare = self._spare()  # asked every window: it answers for the time since the last
        if self._at_rest() and not (refused or cut):
            return  # at rest, as an idle server is: nothing pushes it up, it can go no lower
        before = self.level
        ceiling = self._ceiling()
        gone = spare and not (refused or cut) and self._let_go()
        failed = cut and self._probation is not None  # latency rose since the last step down
        # Read only where it can move the level, once a window at most: a report is not
        # free, and at the ceiling it is read once per cool stretch, not every window.
        below_ceiling = 0.0 < self.level < ceiling
        short = not (gone or refused or failed) and below_ceiling and self._pools_short()
        if refused or failed or short:
            if self._probation is not None:  # the last step down brought refusals back
                self._backoff, self._probation = min(self._backoff + 1, BACKOFF_MAX), None
                self._avoid = (
                    self.level,
                    self._clock.monotonic() + (AVOID_S << (self._backoff - 1)),
                )
            self._cool = 0
            self.level = min(ceiling, self.level + STEP)
        elif gone or cut or self._queue_standing():
            self._cool = 0
        else:
            self._cool += 1
            if self._probation is not None:
                self._probation += 1
                if self._probation >= PROBATION_WINDOWS:  # the step down held: the base pace again
                    self._backoff, self._probation = 0, None
            if self._cool >= COOL_WINDOWS << self._backoff:
                self._cool = 0
                lowered = max(self.min_level, self.level - STEP)
                if lowered < self.level and not below_ceiling and self._pools_short():
                    lowered = self.level  # no slot to spare (below the ceiling: read above)
                if lowered <= self._avoid[0] and self._clock.monotonic() < self._avoid[1]:
                    lowered = self.level  # a level that brought refusals back lately
                self._probation = 0 if lowered < self.level else self._probation
                self.level = lowered
        # Above the ceiling nothing that arrives would be shed: climbing there only slows
        # the way back down once the load falls.
        self.level = round(max(self.min_level, min(self.level, ceiling)), 6)
        self._note_peak(before)
        if self.level != before:
            self.stats.steps += 1
            log.info(
                "brownout level %.2f -> %.2f (%s)",
                before,
                self.level,
                "the load is gone"
                if gone
                else "admission refused calls"
                if refused
                else "latency rose after a step down"
                if failed
                else "a backend pool is short of slots"
                if short
                else "no refusal for a while",
            )

    def _let_go(self) -> bool:
        """The load is gone (admission had room to spare): the level to its floor at once,
        unless a backend pool is short of slots; whether it went."""
        if self.level <= self.min_level or self._pools_short():
            return False
        self.level = self.min_level
        self._cool, self._backoff, self._probation = 0, 0, None
        return True

    def _note_peak(self, before: float) -> None:
        now = self._clock.monotonic()
        self._windows.append(
            (now, max(before, self.level), _total(self.stats.lighter), _total(self.stats.refused))
        )
        while self._windows and self._windows[0][0] < now - REPORT_WINDOW_S:
            self._windows.popleft()

    def recent(self) -> tuple[float, int, int]:
        """Over the last :data:`REPORT_WINDOW_S` (the pools' window): the highest level, the
        calls answered lighter and the calls refused."""
        peak = max([self.level, *(window[1] for window in self._windows)])
        lighter, refused = _total(self.stats.lighter), _total(self.stats.refused)
        if not self._windows:
            return peak, lighter, refused
        return peak, lighter - self._windows[0][2], refused - self._windows[0][3]

    def _ceiling(self) -> float:
        """The top of the highest rung that names a criticality seen lately: the most that
        shedding can do for the calls that arrive."""
        arrived = [c for c, count in enumerate(self.arrivals) if count]
        self.arrivals = [0] * len(Criticality)
        self._present.append(max((_TOP[c] for c in arrived), default=0.0))
        return max(self._present)


def _total(counts: dict[str, int]) -> int:
    return sum(counts.values())
