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

    with gate.admitted(deadline, connection) as call:     # raises FanOutOverloaded
        result = fanout.run(plan(), context.by(call.deadline))

The gate makes the call's one :class:`~service.overload.ticket.CallTicket` and hands only
that on: to admission's verbs, and to the backends' slots as the flow the call's deadline
carries (:attr:`AdmittedCall.deadline`); admission alone works the limit, its line, the
callers' shares and the pause to tell.

**Pacing** (:class:`~service.overload.pacing.ConnectionPacing`, one per connection). A
refusal costs the process a read, a decode and a reply, a small part of an admitted
call's cost. A caller that
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
calls in flight than its fair share (:mod:`service.overload.fair_share`). The same
holds while the brownout dimmer refuses every call of the criticality that caller's last
call carried.

The gate's counters and admission's state are series of the service
(:mod:`service.operations.service_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.engine.settings import AdmissionSettings
from service.engine.tasks import FanOutOverloaded, RequiredTaskFailed, TaskStatus
from service.idl import appstats
from service.overload.admission import AdmissionControl, Refused
from service.overload.brownout import REFUSED_FROM, BrownoutVerdict, Criticality, Dimmer
from service.overload.fair_share import ANONYMOUS
from service.overload.pacing import ConnectionPacing
from service.overload.ticket import CallTicket
from service.wire.header import call_header

__all__ = [
    "CallGate",
    "AdmittedCall",
    "GateStats",
    "UnreadRefusals",
]

WHOLE, LIGHTER, REFUSED = BrownoutVerdict.WHOLE, BrownoutVerdict.LIGHTER, BrownoutVerdict.REFUSED


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

    ``ticket``: the call's, as the gate made it; ``lighter``: answer it without its
    optional panels (brownout). ``measured``: whether
    the call's latency says how long the service takes; :meth:`ran` sets it from the
    call's task outcomes, and admission leaves an unmeasured call's latency out, as
    concurrency-limits' ``onIgnore``.
    """

    ticket: CallTicket
    lighter: bool
    measured: bool = True

    @property
    def deadline(self) -> Deadline:
        """The call's deadline, carrying its place in the backends' lines (the ticket's
        flow, set as admission admitted it): the one its tasks run by. They wait for backend
        slots by criticality, then fairly among callers by weight, not behind a storm."""
        return self.ticket.deadline.for_flow(self.ticket.flow)

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
        self._hold_refusals = settings.hold_refusals
        self.admission = admission = AdmissionControl(
            settings, request_deadline_ms, clock=clock, weights=weights
        )
        self.dimmer = Dimmer(
            lambda: admission.refusals_decided,
            lambda: admission.queue_standing,
            latency_cuts=lambda: admission.latency_cuts,
            pressure=admission.pressure,
            pools_short=pools_short,
            spare=admission.room_to_spare,
            enabled=settings.brownout,
            min_level=settings.brownout_min_level,
            clock=clock,
        )
        self.stats = GateStats()

    @contextmanager
    def admitted(
        self,
        deadline: Deadline,
        connection: ConnectionPacing | None = None,
        criticality: Criticality = Criticality.CRITICAL,
        name: str | None = None,
    ) -> Iterator[AdmittedCall]:
        """Admit a call of ``criticality`` due by ``deadline`` from ``connection`` (when its
        refusals are paced) for the block's length; the block gets its
        :class:`AdmittedCall`. Its caller for fair share is the connection's certificate
        name, else ``name`` (``RequestMeta.caller``), else :data:`ANONYMOUS`.

        Raises :class:`FanOutOverloaded` when it is refused (by the dimmer or admission),
        or when the block raises it (no task could start); either way paced.
        """
        ticket = self._ticket(deadline, connection, criticality, name)
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
            call = AdmittedCall(ticket, verdict is LIGHTER)
            with self._admission(call):
                yield call
        except FanOutOverloaded as overloaded:
            raise self._refused(overloaded, ticket, shed) from None
        except RequiredTaskFailed:
            if ticket.connection is not None:
                ticket.connection.answered()
            raise
        if ticket.connection is not None:
            ticket.connection.answered()

    def _ticket(
        self,
        deadline: Deadline,
        connection: ConnectionPacing | None,
        criticality: Criticality,
        name: str | None,
    ) -> CallTicket:
        """The call's ticket: its caller arrived, its connection told (when paced)."""
        identity = connection.identity if connection is not None else ""
        caller = self.admission.arrived(identity or name or ANONYMOUS)
        if connection is not None:
            connection.caller = caller
            if not self._hold_refusals:
                connection = None
            else:
                connection.arrived(deadline, criticality)
        return CallTicket(deadline, criticality, caller, connection)

    def _refused(
        self, overloaded: FanOutOverloaded, ticket: CallTicket, shed: bool
    ) -> FanOutOverloaded:
        """Count and pace a refusal: the one to raise (:meth:`AdmissionControl.refused`
        says how; the engine's own refusal, no task could start, was told no pause)."""
        self.stats.count_refusal(ticket.criticality)
        refusal = self.admission.refused(ticket, overloaded.retry_after_ms, shed)
        if refusal.retry_after_ms != overloaded.retry_after_ms:
            overloaded = FanOutOverloaded(str(overloaded), refusal.retry_after_ms)
        connection = ticket.connection
        if connection is not None:
            if not refusal.paced:
                connection.answered()
            # Paced: the server holds the reply as long as this says (ConnectionPacing.take_hold).
            elif connection.refused(refusal.retry_after_ms, ticket.deadline) > 0:
                self.stats.held += 1
        return overloaded

    @contextmanager
    def _admission(self, call: AdmittedCall) -> Iterator[None]:
        ticket = call.ticket
        try:
            self.admission.admit(ticket)
        except Refused as refused:
            raise FanOutOverloaded(str(refused), refused.retry_after_ms) from None
        started = self.clock.monotonic()
        try:
            yield
        except BaseException:
            call.measured = False  # a required panel failed, or no task could start
            raise
        finally:
            latency_s = self.clock.monotonic() - started if call.measured else None
            self.admission.done(ticket, latency_s)

    def refused_unread(self, connection: ConnectionPacing) -> int:
        """A call refused from its header alone (:class:`UnreadRefusals`), counted
        and paced: the ``retry_after_ms`` to tell it."""
        retry_after_ms = self.admission.refuse_unread(connection.criticality, connection.caller)
        self.stats.count_refusal(connection.criticality)
        if connection.refused_unread(retry_after_ms) > 0:
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
    hold the answer is the caller's :meth:`ConnectionPacing.take_hold`.
    It never blocks, so the hub's callbacks may call it.
    """

    def __init__(self, gate: CallGate, protocol: str) -> None:
        self._gate = gate
        self._admission = gate.admission
        self._dimmer = gate.dimmer
        self._protocol = protocol

    def __call__(self, connection: ConnectionPacing, message: Any) -> tuple[str, int, Any] | None:
        if not connection.back_early() or not (
            self._admission.saturated or self._dimmer.level >= REFUSED_FROM[connection.criticality]
        ):
            return None
        caller = connection.caller
        if caller is not None and self._admission.runs_under_share(caller):
            # Read it: admission serves a caller under its share first, and a freed slot
            # goes to the caller with the fewest calls in flight for its weight. By demand
            # (waiting calls too) two storms are both over their share, and refused unread
            # alike they reached admission at the same rate, whatever their weights.
            return None
        header = call_header(message, self._protocol)
        if header is None or header[0] != _METHOD:
            return None
        retry_after_ms = self._gate.refused_unread(connection)
        result = appstats.AppStats.get_app_stats_result()
        result.overloaded = appstats.Overloaded(message=_MESSAGE, retry_after_ms=retry_after_ms)
        return _METHOD, header[1], result
