"""The gate every call passes once, before any of its tasks is planned, and what a caller
that comes back too soon meets there.

**Brownout** (:mod:`service.overload.brownout`) comes first, and only under overload:
the dimmer may answer a call lighter (its optional panels not run) or refuse it, the
least critical calls first. **Admission** (:mod:`service.overload.admission`) decides
whether the call may run:
one that would wait too long is refused at once, having cost almost nothing but its
validation. The engine (:class:`~service.engine.fanout.FanOut`) runs the tasks of an
admitted call and knows of none of this: when it finds no slot for any task, its
:class:`~service.engine.tasks.FanOutOverloaded` passes out through the gate, which
gives it the ``retry_after_ms`` admission advises and paces it like any refusal::

    with gate.admitted(deadline, caller):     # raises FanOutOverloaded
        result = fanout.run(plan(), context)

**Pacing** (:class:`CallerPacing`, one per connection). A refusal costs the process a
read, a decode and a reply, about a fiftieth of an admitted call. A caller that
honours ``retry_after_ms`` is refused a few times a second; one that tries again at
once (a retry loop in a web tier, users pressing reload) is refused as fast as the
process can refuse, and a thousand such callers take the whole CPU from the calls
that were admitted. A Thrift connection is strictly request-reply: until it has its
answer, a caller sends nothing more on it. So a caller that came back before the
pause it was told gets its next refusal *held*: answered ``Overloaded`` as before,
but only once ``retry_after_ms`` has passed, or shortly before the call's deadline,
whichever is first. It is never answered late, and every caller is throttled to
about one refusal per ``retry_after_ms`` (or per deadline) whatever it does, at the
cost of a timer. The gate decides how long; the holding is the server's
(:mod:`service.overload.held_connections`, or a sleep in the call's greenlet).
Weighed against the alternatives:

* *Not reading a refused connection until its pause has passed* throttles as well,
  but the next call then waits unread while its caller's clock runs: it would be
  answered late, or be refused on arrival with its budget gone.
* *Pausing all reads at the limit* holds back the polite callers and the admitted
  calls' successors together, and the kernel's buffers fill with calls whose
  deadlines run out unseen.
* *Per-connection fairness* does not help: each of these callers has one call in
  flight, and there are simply too many callers.
* *Adaptive LIFO* (admission's queue) decides which waiting call goes first; it does
  not make refusing cheaper.

Callers that honour ``retry_after_ms`` (with the usual x0.5 to x1.5 jitter) are never
held, so they, and the web-tier client trying another instance, are refused at once.

**Refusing unread** (:class:`UnreadRefusals`). What pacing leaves is the cost of each
refusal, most of it reading the call: decoding, validating, a span, planning, for an
answer decided in advance. So while admission is saturated, a ``get_app_stats`` from
a connection whose caller came back before its pause is answered ``Overloaded`` from
the message header alone (method name and seqid, :func:`service.wire.header.call_header`,
every length checked again; the rest is never decoded nor scanned). It is held as any
paced refusal, within the deadline that caller's last call carried, and counted as
every refusal is (``fanout.calls.overloaded``, ``fanout.calls.held``,
``rpc.server.call.duration`` with ``error.type`` ``Overloaded``). It makes no span. A
malformed call from such a caller is refused, not rejected, until it is read. Other
callers and other methods are read as usual, and so are the calls of a caller with fewer
calls in flight than its fair share (:mod:`service.overload.caller_shares`). The same
holds while the brownout dimmer refuses every call of the criticality that caller's last
call carried.

The gate's counters and admission's state are series of the service
(:mod:`service.operations.service_metrics`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from lookups.backends.ordered_slots import CALL_FLOW, Flow
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.engine.settings import AdmissionSettings
from service.engine.tasks import FanOutOverloaded, RequiredTaskFailed, TaskStatus
from service.idl import appstats
from service.overload.admission import AdmissionControl, Refused
from service.overload.brownout import REFUSED_FROM, BrownoutVerdict, Criticality, Dimmer
from service.overload.caller_shares import ANONYMOUS, CallerShare
from service.wire.header import call_header

__all__ = [
    "CallGate",
    "AdmittedCall",
    "GateStats",
    "CallerPacing",
    "current_caller",
    "UnreadRefusals",
]

WHOLE, LIGHTER, REFUSED = BrownoutVerdict.WHOLE, BrownoutVerdict.LIGHTER, BrownoutVerdict.REFUSED

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

#: The caller (connection) of the call being served; set by the server per call.
current_caller: ContextVar[CallerPacing | None] = ContextVar("fanout_caller", default=None)


class CallerPacing:
    """One connection's refusals: when it was told to come back, and whether it did."""

    __slots__ = (
        "_back_at",
        "_clock",
        "_early",
        "_last_deadline_ms",
        "_hold_s",
        "criticality",
        "identity",
        "share",
    )

    def __init__(self, clock: Clock = SYSTEM_CLOCK, identity: str = "") -> None:
        self._clock = clock
        #: The name of the connection's client certificate (mutual TLS), or "".
        self.identity = identity
        #: The caller of this connection's last call read (for a call refused unread).
        self.share: CallerShare | None = None
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


@dataclass
class GateStats:
    """Calls answered ``Overloaded`` (and by criticality), and of those the ones held for
    pacing."""

    overloaded: int = 0
    held: int = 0
    refused: dict[str, int] = field(default_factory=lambda: {c.name: 0 for c in Criticality})

    def count_refusal(self, criticality: Criticality) -> None:
        self.overloaded += 1
        self.refused[criticality.name] = self.refused.get(criticality.name, 0) + 1


#: Task ends that say nothing of what a call costs: an error (at once on an open circuit,
#: or after the wait for a server that is down) and a task cut short by a sibling's failure.
UNMEASURED_ENDS = frozenset({TaskStatus.ERROR, TaskStatus.CANCELLED})


@dataclass
class AdmittedCall:
    """What the gate tells the block of an admitted call, and what the block tells back.

    ``lighter``: answer it without its optional panels (brownout). ``measured``: whether
    the call's latency says how long the service takes; :meth:`ran` sets it from the
    call's task outcomes, and admission leaves an unmeasured call's latency out, as
    concurrency-limits' ``onIgnore``.
    """

    lighter: bool
    measured: bool = True

    def ran(self, statuses: Iterable[TaskStatus]) -> None:
        """The call's tasks ended with ``statuses``. It is measured only when every task
        did its work or ran out of time (``OK``, ``TIMEOUT``, ``REJECTED``: the load).

        A task that failed (:data:`UNMEASURED_ENDS`) did not do the work a call costs:
        during a backend outage such calls end as soon as the other panels do, or when
        the wait for the dead server ends, and a limit learnt from them would fall to its
        floor and stay there once the backend was back.
        """
        self.measured = not any(status in UNMEASURED_ENDS for status in statuses)


class CallGate:
    """Brownout, admission and pacing for every call of one server."""

    def __init__(
        self,
        settings: AdmissionSettings,
        request_deadline_ms: int,
        pools_short: Callable[[], bool] = lambda: False,
        clock: Clock = SYSTEM_CLOCK,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        """``pools_short``: whether a backend pool is short of slots (for the dimmer);
        ``clock``: the service's, which admission, the dimmer and the calls' deadlines read;
        ``weights``: callers' weights for fair share, by name."""
        self.clock = clock
        self.admission = admission = AdmissionControl(
            settings, request_deadline_ms, clock=clock.monotonic, weights=weights
        )
        self.dimmer = Dimmer(
            lambda: admission.refusals_decided,
            lambda: admission.queue_standing,
            latency_cuts=lambda: admission.stats.latency_cuts,
            pressure=admission.pressure,
            pools_short=pools_short,
            spare=admission.room_to_spare,
            enabled=settings.brownout,
            min_level=settings.brownout_min_level,
            clock=clock.monotonic,
        )
        self.stats = GateStats()

    @contextmanager
    def admitted(
        self,
        deadline: Deadline,
        caller: CallerPacing | None = None,
        criticality: Criticality = Criticality.CRITICAL,
        name: str | None = None,
    ) -> Iterator[AdmittedCall]:
        """Admit a call of ``criticality`` due by ``deadline`` from ``caller`` (the
        connection's, when its refusals are paced) for the block's length; the block gets
        its :class:`AdmittedCall`. Its caller for fair share is the connection's certificate
        name, else ``name`` (``RequestMeta.caller``), else :data:`ANONYMOUS`.

        Raises :class:`FanOutOverloaded` when it is refused (by the dimmer or admission),
        or when the block raises it (no task could start); either way paced.
        """
        share = self.admission.callers.arrived(
            (caller.identity if caller is not None else "") or name or ANONYMOUS
        )
        if caller is not None:
            caller.share = share
        caller = caller if self.admission.settings.hold_refusals else None
        if caller is not None:
            caller.arrived(deadline, criticality)
        shed = False
        try:
            # Below any overload the level is 0, and the call never reaches the dimmer.
            self.dimmer.arrivals[criticality] += 1
            verdict = self.dimmer.decide(criticality) if self.dimmer.level else WHOLE
            if verdict is REFUSED:
                shed = True
                raise FanOutOverloaded(
                    f"shed under load (brownout): a {criticality.name} call",
                    self.admission.shed(criticality),
                )
            call = AdmittedCall(verdict is LIGHTER)
            with self._admission(deadline, criticality, call, share):
                yield call
        except FanOutOverloaded as overloaded:
            raise self._refused(overloaded, deadline, criticality, caller, share, shed) from None
        except RequiredTaskFailed:
            if caller is not None:
                caller.answered()
            raise
        if caller is not None:
            caller.answered()

    def _refused(
        self,
        overloaded: FanOutOverloaded,
        deadline: Deadline,
        criticality: Criticality,
        caller: CallerPacing | None,
        share: CallerShare,
        shed: bool,
    ) -> FanOutOverloaded:
        """Count and pace a refusal: the one to raise. A caller under its fair share, refused
        by admission or the engine (not shed by the dimmer), is not held and is told the
        shortest pause: the storm is another caller's."""
        self.stats.count_refusal(criticality)
        self.admission.callers.refused(share)
        fair = not shed and self.admission.under_share(share)
        if fair:
            overloaded = FanOutOverloaded(str(overloaded), self.admission.retry_after.least_ms())
        elif not overloaded.retry_after_ms:  # the engine's: no task could start
            overloaded = FanOutOverloaded(
                str(overloaded), self.admission.retry_after_ms(criticality)
            )
        if caller is not None:
            if fair:
                caller.answered()
            # Paced: the server holds the reply as long as this says (CallerPacing.take_hold).
            elif caller.refused(overloaded.retry_after_ms, deadline) > 0:
                self.stats.held += 1
        return overloaded

    @contextmanager
    def _admission(
        self, deadline: Deadline, criticality: Criticality, call: AdmittedCall, share: CallerShare
    ) -> Iterator[None]:
        try:
            self.admission.admit(deadline, criticality, share)
        except Refused as refused:
            raise FanOutOverloaded(str(refused), refused.retry_after_ms) from None
        # The call's tasks run in copies of this context: they wait for backend slots by
        # criticality, then fairly among callers by weight, not behind another's storm.
        fair = self.admission.settings.fair_share
        flow = CALL_FLOW.set(Flow(int(criticality), share.name if fair else "", share.weight))
        started = self.clock.monotonic()
        try:
            yield
        except BaseException:
            call.measured = False  # a required panel failed, or no task could start
            raise
        finally:
            CALL_FLOW.reset(flow)
            self.admission.done(self.clock.monotonic() - started if call.measured else None, share)

    def refused_unread(self, caller: CallerPacing) -> int:
        """A call refused from its header alone (:class:`UnreadRefusals`), counted
        and paced: the ``retry_after_ms`` to tell it."""
        retry_after_ms = self.admission.refuse_unread(caller.criticality)
        self.stats.count_refusal(caller.criticality)
        if caller.share is not None:
            self.admission.callers.refused(caller.share)
        if caller.refused_unread(retry_after_ms) > 0:
            self.stats.held += 1
        return retry_after_ms


_METHOD = "get_app_stats"
_MESSAGE = (
    "overloaded: this connection called again before the retry_after_ms it was "
    "told; refused without being read"
)


class UnreadRefusals:
    """Decides, from a checked message and its connection's caller, whether to refuse it unread.

    Call it with each message before decoding: it returns ``(method, seqid,
    result)`` to answer with, or None to serve the message as usual. How long to
    hold the answer is the caller's :meth:`CallerPacing.take_hold`.
    It never blocks, so the hub's callbacks may call it.
    """

    def __init__(self, gate: CallGate, protocol: str) -> None:
        self._gate = gate
        self._admission = gate.admission
        self._dimmer = gate.dimmer
        self._protocol = protocol

    def __call__(self, caller: CallerPacing, message: Any) -> tuple[str, int, Any] | None:
        if not caller.back_early() or not (
            self._admission.saturated or self._dimmer.level >= REFUSED_FROM[caller.criticality]
        ):
            return None
        if caller.share is not None and self._admission.runs_under_share(caller.share):
            # Read it: admission serves a caller under its share first, and a freed slot
            # goes to the caller with the fewest calls in flight for its weight. By demand
            # (waiting calls too) two storms are both over their share, and refused unread
            # alike they reached admission at the same rate, whatever their weights.
            return None
        header = call_header(message, self._protocol)
        if header is None or header[0] != _METHOD:
            return None
        retry_after_ms = self._gate.refused_unread(caller)
        result = appstats.AppStats.get_app_stats_result()
        result.overloaded = appstats.Overloaded(message=_MESSAGE, retry_after_ms=retry_after_ms)
        return _METHOD, header[1], result
