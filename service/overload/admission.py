"""Admission: let in only the calls the process can finish within their deadlines.

A limit on calls in flight follows measured latency (the gradient of Netflix's
concurrency-limits ``Gradient2``): each admitted call's latency feeds a
short-term and a long-term average, and the limit is scaled by
``tolerance x long / short``, kept within [0.5, 1] so it never more than halves
at once, plus a small allowance to grow by. When latency stands still the
limit grows; when it jumps (a slow backend, a saturated pool, a busy core) the
limit falls within a few calls. Because the long-term average slowly follows
the short one, latency is also held under an absolute ceiling,
``max_latency_fraction`` of ``fanout.request_deadline_ms``: beyond it, the
limit is cut in proportion whatever the gradient says. While fewer calls are
in flight or waiting than half the limit, and none was refused since the last
update, the limit does not grow (nothing measured it).

Latency alone lets a CPU-bound process take too much, so the event loop's demand for a
core is measured too: while the loop is saturated and a quarter of the limit is in use,
the limit moves a step a window by how long calls queue for the core
(:mod:`service.overload.cpu_rule`). In use means a quarter of it here, where growing
takes half, so that a loop saturated by its calls always finds it in use (at half, a
limit just past twice the calls in use never fell); a limit used less is left alone
(something else saturates the loop).

A call finding the limit reached is admitted all the same when its caller is under its
fair share while others are active (:mod:`service.overload.fair_share`: the limit was
reached by callers over theirs). Any other waits in a bounded line, the more critical first
(:mod:`service.overload.waiting_line`: adaptive LIFO and CoDel). A call is refused at
once, without queueing, when its remaining deadline is shorter than its expected wait
(behind the waiters as critical as it or more) plus the typical latency, or when the
line is full of waiters as critical as it or more.

A refusal carries ``retry_after_ms``, steered from the server's refusals
(:mod:`service.overload.retry_after`).

The limit counts calls and stays within ``admission.min_limit`` and
``admission.max_limit``; ``fanout.max_inflight_tasks`` remains the hard cap on
tasks, enforced by :class:`~service.engine.fanout.FanOut`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import gevent.event

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.flow import Flow
from service.engine.settings import AdmissionSettings
from service.overload.brownout import Criticality
from service.overload.cpu_rule import CpuRule
from service.overload.fair_share import CallerCounts, CallerState, FairShare
from service.overload.retry_after import RetryAfter
from service.overload.ticket import CallTicket
from service.overload.waiting_line import CHOICE, WaitingLine, criticality_at, place_of
from tracing.pools import cpu_demand_s

__all__ = ["AdmissionControl", "AdmissionSnapshot", "AdmissionStats", "Refusal", "Refused"]

_SHORT_WEIGHT = 0.2  # the short-term latency average: about the last five calls
_LONG_WEIGHT = 0.01  # the long-term one: about the last hundred
_SMOOTHING = 0.2  # how far one update moves the limit towards its new value
_GROW_IN_USE = 0.5  # the limit grows only while this share of it is in use...
_CPU_IN_USE = 0.25  # ...and moves for the CPU while this share is (see above)


class Refused(Exception):
    """The call may not start now; ``retry_after_ms`` says when trying again makes sense."""

    def __init__(self, reason: str, retry_after_ms: int) -> None:
        super().__init__(reason)
        self.retry_after_ms = retry_after_ms


@dataclass
class AdmissionStats:
    """Counters since start."""

    admitted: int = 0
    queued: int = 0
    refused: int = 0  # every refusal, whatever the reason
    refused_deadline: int = 0  # ...of which: the deadline could not be met
    refused_queue: int = 0  # ...of which: the queue was full or the wait ran out
    refused_unread: int = 0  # ...of which: a caller back too early, refused before reading
    latency_cuts: int = 0  # rounds of cuts to the limit because latency rose


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Admission's state at one moment, copied: what the service's metrics and reports read."""

    limit: int
    min_limit: int
    inflight: int
    queued: int
    #: Calls admitted, refused and in flight by caller label (fair share)...
    callers: Mapping[str, CallerCounts] = field(default_factory=dict)
    #: ...and each label's weight, and its share of the limit now (0: not active).
    caller_weights: Mapping[str, float] = field(default_factory=dict)
    caller_shares: Mapping[str, float] = field(default_factory=dict)


class Refusal(NamedTuple):
    """How a refused call is answered: the pause to tell it, and whether its caller's
    connection is paced (held if it came back early); a caller under its fair share,
    refused for another's storm, is not."""

    retry_after_ms: int
    paced: bool


class AdmissionControl:
    """The adaptive limit on calls in flight, its queue, the callers' fair shares, the CPU
    rule and ``retry_after_ms``: the one owner of who is served under overload.

    Its verbs, each given the call's :class:`~service.overload.ticket.CallTicket`:
    :meth:`admit` before the work and :meth:`done` after it, exactly once per admitted
    call (:class:`~service.overload.gate.CallGate` does both); :meth:`refused` for a call
    refused however; :meth:`refuse_unread` and :meth:`shed` for refusals decided before
    it; :meth:`snapshot` to read it. A ticket's caller comes from :meth:`arrived`.
    ``clock`` (the service's) decides whether the queue stands and when
    ``retry_after_ms`` is steered, and ``cpu_demand`` (seconds the loop's thread ran or
    waited for a core, so far) whether the loop is CPU-saturated; tests pass their own. A
    call's deadline reads the same clock (the service gives both); waiting itself keeps
    real time.
    """

    def __init__(
        self,
        settings: AdmissionSettings,
        request_deadline_ms: int,
        clock: Clock = SYSTEM_CLOCK,
        cpu_demand: Callable[[], float] = cpu_demand_s,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        """``weights``: callers' weights by name (``[callers.<name>]``; others weigh 1)."""
        self._settings = settings
        self._clock = clock
        fair = settings.fair_share  # read here alone: the parts below are told
        self._callers = FairShare(weights or {}, settings.max_callers, clock, enabled=fair)
        self.cpu = CpuRule(clock, cpu_demand, settings.cpu_saturated)
        self.stats = AdmissionStats()
        self.limit = float(settings.initial_limit)
        self.inflight = 0
        self._ceiling_s = settings.max_latency_fraction * request_deadline_ms / 1000.0
        self._short_s = self._long_s = 0.0
        self._samples_since_update = 0
        self._cut_at, self._cut_from = -math.inf, self.limit  # the current round of cuts
        self._line = WaitingLine(settings, clock, choice=CHOICE if fair else 1)
        self._retry_after = RetryAfter(clock, lambda: self._short_s)
        self._refused_since_update = 0
        self._peak_inflight, self._waited = 0, False  # since room_to_spare() last looked
        #: Set at each refusal admission decides and each cut of its limit: the brownout
        #: dimmer, at rest, sleeps on it instead of looking four times a second.
        self.pressure = gevent.event.Event()

    @property
    def queued(self) -> int:
        return len(self._line.waiters)

    def arrived(self, name: str) -> CallerState:
        """A call from the caller ``name`` arrived now: the caller, for its ticket."""
        return self._callers.arrived(name)

    def admit(self, ticket: CallTicket) -> None:
        """Return once the call may start, its ticket's flow set; raise :class:`Refused`
        if it should not."""
        rank, caller = int(ticket.criticality), ticket.caller
        if not self.saturated or (caller is not None and self.under_share(caller)):
            # Under its share while others are active, the limit was reached by callers over
            # theirs: this caller's share is its own, as a partition under its limit is
            # admitted by concurrency-limits' partitioned limiters. What that lets in past
            # the limit is bounded by the shares of the callers under theirs.
            self._admitted(rank, caller)
        else:
            self._queue(ticket, place_of(rank, caller is not None and self.over_share(caller)))
        ticket.flow = self._flow(ticket)

    def over_share(self, caller: CallerState) -> bool:
        """Whether one more call of ``caller`` would take it past its fair share of the
        limit (never, with ``admission.fair_share`` off)."""
        return self._callers.over(caller, self._cap())

    def under_share(self, caller: CallerState) -> bool:
        """Whether ``caller`` is under its fair share while other callers are active: its
        refusals come of another's demand (never, with ``admission.fair_share`` off)."""
        return self._callers.under(caller, self._cap())

    def runs_under_share(self, caller: CallerState) -> bool:
        """Whether ``caller`` has fewer calls in flight than its fair share while other
        callers are active, however many it has waiting (never, with fair share off)."""
        return self._callers.runs_under(caller, self._cap())

    def done(self, ticket: CallTicket, latency_s: float | None) -> None:
        """The admitted call of ``ticket`` ended after ``latency_s`` (None: a call that says
        nothing of the service's latency, as concurrency-limits' ``onIgnore``): update the
        limit, pass the slot on."""
        self.inflight -= 1
        if ticket.caller is not None:
            self._callers.done(ticket.caller)
        if latency_s is not None:
            self._sample(latency_s)
        self._hand_over()

    def refused(self, ticket: CallTicket, told_ms: int, shed: bool = False) -> Refusal:
        """The call of ``ticket`` is refused (by admission or the engine, or ``shed`` by
        the dimmer), so far told ``told_ms`` (0: nothing): count it against its caller, and
        say how to answer it. A caller under its fair share, refused by admission or the
        engine, is told the shortest pause and not paced: the storm is another caller's."""
        caller = ticket.caller
        if caller is not None:
            self._callers.refused(caller)
        if not shed and caller is not None and self.under_share(caller):
            return Refusal(self.least_retry_after_ms(), paced=False)
        return Refusal(told_ms or self.retry_after_ms(ticket.criticality), paced=True)

    def refuse_unread(
        self, criticality: Criticality = Criticality.CRITICAL, caller: CallerState | None = None
    ) -> int:
        """Count a refusal decided before the call was read (a caller back too early while
        :attr:`saturated`, or while the dimmer refuses its kind: :mod:`service.overload.gate`),
        against ``caller``, that of its connection's last call; the ``retry_after_ms`` to
        answer. Only the first kind is demand for the limit."""
        self.stats.refused_unread += 1
        self._count_refusal(int(criticality), demand=self.saturated)
        if caller is not None:
            self._callers.refused(caller)
        return self.retry_after_ms(criticality)

    def shed(self, criticality: Criticality) -> int:
        """Count a call the dimmer refused, for ``retry_after_ms`` only (the dimmer follows
        admission's own refusals, not its own); the ``retry_after_ms`` to answer. Uncounted,
        a shed caller's pause fell to its floor, and one ignoring it was never held."""
        self._retry_after.refused(criticality)
        return self.retry_after_ms(criticality)

    def retry_after_ms(self, criticality: Criticality = Criticality.CRITICAL) -> int:
        """When a refused caller of ``criticality`` should try again, in milliseconds."""
        return self._retry_after.ms(criticality)

    def least_retry_after_ms(self) -> int:
        """The shortest pause told: to a caller refused under its fair share."""
        return self._retry_after.least_ms()

    def snapshot(self) -> AdmissionSnapshot:
        """Admission's state now, copied (the counters go on counting)."""
        callers, cap = self._callers, self._cap()
        return AdmissionSnapshot(
            limit=int(self.limit),
            min_limit=self._settings.min_limit,
            inflight=self.inflight,
            queued=self.queued,
            callers={label: dataclasses.replace(c) for label, c in callers.counts.items()},
            caller_weights={label: callers.weight_of(label) for label in callers.counts},
            caller_shares=callers.shares(cap),
        )

    @property
    def latency_cuts(self) -> int:
        """Rounds of cuts to the limit because latency rose, since start."""
        return self.stats.latency_cuts

    def _flow(self, ticket: CallTicket) -> Flow:
        """The call's place in the backends' lines: by criticality, then fairly among
        callers by weight (no caller, with fair share off)."""
        caller = ticket.caller
        if caller is None or not self._callers.enabled:
            return Flow(int(ticket.criticality))
        return Flow(int(ticket.criticality), caller.name, caller.weight)

    def room_to_spare(self) -> bool:
        """Whether, since the last time this was asked, no call waited and no more than half
        the limit was ever in flight (the brownout dimmer asks once a window)."""
        spare = not self._waited and self._peak_inflight <= self.limit * _GROW_IN_USE
        self._peak_inflight, self._waited = self.inflight, bool(self._line.waiters)
        return spare and self._settings.enabled

    @property
    def refusals_decided(self) -> int:
        """Refusals admission decided itself (not those of callers back too early)."""
        return self.stats.refused - self.stats.refused_unread

    @property
    def queue_standing(self) -> bool:
        """Whether calls have waited without the queue draining for longer than its interval."""
        return self._line.standing

    @property
    def saturated(self) -> bool:
        """True while a call arriving now would have to queue: the limit is reached."""
        return self._settings.enabled and (self.inflight >= self._cap() or bool(self._line.waiters))

    # --- the queue -------------------------------------------------------------------

    def _queue(self, ticket: CallTicket, place: int) -> None:
        """Wait at ``place`` in the line, or be refused at once: when the remaining deadline
        is shorter than the expected wait plus a typical call, or the line is full of waiters
        at ``place`` or further forward."""
        rank = criticality_at(place)
        expected_s = self._expected_wait_s(place) + self._short_s
        if ticket.deadline.remaining_s() < expected_s:
            self.stats.refused_deadline += 1
            raise self._refuse("cannot finish within its deadline at the current load", rank)
        if len(self._line.waiters) >= max(
            int(self.limit), self._settings.min_limit
        ) and not self._line.evict_behind(place):
            self.stats.refused_queue += 1
            raise self._refuse("the admission queue is full", rank)
        self._wait(ticket.deadline, place, ticket.caller)

    def _wait(self, deadline: Deadline, place: int, caller: CallerState | None) -> None:
        line = self._line
        waiter, longest_s = line.join(place, caller)
        self.stats.queued += 1
        self._waited = True
        if caller is not None:
            caller.waiting += 1
        try:
            waited_s = min(longest_s, max(0.0, deadline.remaining_s() - self._short_s))
            self._clock.wait(waiter.event, self._clock.monotonic() + waited_s)
        finally:
            if caller is not None:
                caller.waiting -= 1
            if not waiter.admitted:
                line.leave(waiter)
        if not waiter.admitted:
            self.stats.refused_queue += 1
            raise self._refuse("no call finished while this one waited", criticality_at(place))

    def _hand_over(self) -> None:
        while self._line.waiters and self.inflight < self._cap():
            waiter = self._line.admit_next()
            assert waiter is not None  # the line holds waiters
            self._admitted(criticality_at(waiter.place), waiter.caller)

    def _expected_wait_s(self, place: int) -> float:
        """Roughly how long a newcomer would queue: those ahead of it, at the current pace."""
        if self._short_s <= 0 or self.limit < 1:
            return 0.0
        return (self._line.ahead_of(place) + 1) * self._short_s / self.limit

    # --- the limit -------------------------------------------------------------------

    def _sample(self, latency_s: float) -> None:
        self.cpu.call_ended(latency_s)
        if self._long_s == 0.0:
            self._short_s = self._long_s = latency_s
        else:
            self._short_s += _SHORT_WEIGHT * (latency_s - self._short_s)
            self._long_s += _LONG_WEIGHT * (latency_s - self._long_s)
        if self._long_s > 2.0 * self._short_s:
            self._long_s *= 0.95  # latency fell a lot: let the baseline follow it quicker
        self._samples_since_update += 1
        if self._samples_since_update >= max(4, int(math.sqrt(self.limit))):
            self._samples_since_update = 0
            self._update_limit()

    def _update_limit(self) -> None:
        if self.cpu.least.lulling:
            return  # its calls say nothing of the limit's
        settings, short_s = self._settings, max(self._short_s, 1e-6)
        gradient = max(0.5, min(1.0, settings.tolerance * self._long_s / short_s))
        if short_s > self._ceiling_s:
            gradient = min(gradient, max(0.5, self._ceiling_s / short_s))
        # Demand reached the limit: calls in flight (the one that just ended included), or
        # waiting, or refused since the last update. Refusals count because callers that come
        # back too early are refused without queueing (pacing): at a small limit they would
        # otherwise never show, and the limit would stay small with the process idle.
        in_use = self.inflight + 1 + len(self._line.waiters)
        refused, self._refused_since_update = self._refused_since_update, 0
        demand = in_use >= self.limit * _GROW_IN_USE or refused
        if gradient < 1.0:
            # One cut per round (a typical call's latency), whole, as deep as the worst
            # gradient in the round: the calls admitted since the round began have not ended,
            # so the same latency must not cut again and again (TCP cuts once per round trip).
            now = self._clock.monotonic()
            if now - self._cut_at >= short_s:
                self._cut_at, self._cut_from = now, self.limit
                self.stats.latency_cuts += 1
                self.pressure.set()
            self._set_limit(min(self.limit, self._cut_from * gradient))
            return
        if (in_use >= self.limit * _CPU_IN_USE or refused) and self.cpu.saturated():
            self._set_limit(self.limit * self.cpu.saturated_step(bool(demand), self._contended))
            return
        if self.cpu.near():
            self._set_limit(self.limit * self.cpu.near_step(gradient >= 1.0 and bool(demand)))
            return
        target = self.limit + math.sqrt(self.limit) if gradient >= 1.0 and demand else self.limit
        self._set_limit(self.limit * (1.0 - _SMOOTHING) + target * _SMOOTHING)

    def _cap(self) -> int:
        """Calls that may be in flight now: the limit, or fewer during a lull to learn the least
        latency (:class:`~service.overload.cpu_rule.LeastLatency`)."""
        return self.cpu.least.cap(self.limit)

    def _contended(self) -> bool:
        return self._callers.contended(self._cap())

    def _set_limit(self, limit: float) -> None:
        self.limit = min(
            float(self._settings.max_limit), max(float(self._settings.min_limit), limit)
        )

    # --- accounting ------------------------------------------------------------------

    def _admitted(self, rank: int, caller: CallerState | None = None) -> None:
        self.inflight += 1
        if self.inflight > self._peak_inflight:
            self._peak_inflight = self.inflight
        if caller is not None:
            self._callers.admitted(caller)
        self.cpu.least.admitted()
        self.stats.admitted += 1
        self._retry_after.admissions[rank > _CRITICAL] += 1  # a counter: see retry_after

    def _refuse(self, reason: str, rank: int) -> Refused:
        self._count_refusal(rank)
        if not self.pressure.is_set():
            self.pressure.set()
        return Refused(reason, self.retry_after_ms(Criticality(rank)))

    def _count_refusal(self, rank: int, demand: bool = True) -> None:
        self.stats.refused += 1
        self._refused_since_update += demand
        self._retry_after.refused(rank)


_CRITICAL = int(Criticality.CRITICAL)
