"""One call's ticket: all the overload parts know of a call, in one object.

The gate (:class:`~service.overload.gate.CallGate`) makes one for each call it reads and
hands only that down: admission (:meth:`~service.overload.admission.AdmissionControl.admit`
and ``done``), the dimmer, and the backends' slots through its :class:`~lookups.flow.Flow`,
which the call's deadline carries. As concurrency-limits' ``Listener``, it is the token a
call holds from its admission to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

from lookups.deadline import Deadline
from lookups.flow import NO_FLOW, Flow
from service.overload.brownout import Criticality
from service.overload.fair_share import CallerState
from service.overload.pacing import ConnectionPacing

__all__ = ["CallTicket"]


@dataclass(slots=True)
class CallTicket:
    """A call at the gate.

    ``caller``: the principal the call is counted against for fair share (None: a call
    outside any caller's count, as in tests of the limit alone); ``connection``: the
    connection's pacing when its refusals are held; ``flow``: the call's place in the
    backends' lines, which admission sets when it admits the call.
    """

    deadline: Deadline
    criticality: Criticality = Criticality.CRITICAL
    caller: CallerState | None = None
    connection: ConnectionPacing | None = None
    flow: Flow = NO_FLOW
