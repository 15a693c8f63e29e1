"""The gate every call passes once, before any of its tasks is planned.

Admission (:mod:`service.overload.admission`) decides whether the call may run:
one that would wait too long is refused at once, having cost almost nothing but
its validation. Pacing (:mod:`service.overload.pacing`) decides how long the server
holds a refusal to a caller that came back before the ``retry_after_ms`` it was
told. The engine (:class:`~service.engine.fanout.FanOut`) runs the tasks of an
admitted call and knows of neither: when it finds no slot for any task, its
:class:`~service.engine.outcomes.FanOutOverloaded` passes out through this gate,
which gives it the ``retry_after_ms`` admission advises and paces it like any
refusal.

    with gate.admitted(deadline, caller):     # raises FanOutOverloaded
        result = fanout.run(plan(), context)

The gate's counters and admission's state are series of the service
(:mod:`service.operations.service_metrics`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional


from lookups.deadline import Deadline
from service.engine.outcomes import FanOutOverloaded, RequiredTaskFailed
from service.engine.settings import AdmissionSettings
from service.overload.admission import AdmissionControl, Refused
from service.overload.pacing import CallerPacing

__all__ = ["CallGate", "GateStats"]


@dataclass
class GateStats:
    """Calls answered ``Overloaded``, and of those the ones held for pacing."""

    overloaded: int = 0
    held: int = 0


class CallGate:
    """Admission and pacing for every call of one server."""

    def __init__(self, settings: AdmissionSettings, request_deadline_ms: int) -> None:
        self.admission = AdmissionControl(settings, request_deadline_ms)
        self.stats = GateStats()

    @contextmanager
    def admitted(self, deadline: Deadline, caller: Optional[CallerPacing] = None) -> Iterator[None]:
        """Admit a call due by ``deadline`` from ``caller`` (the connection's, when its
        refusals are paced) for the block's length.

        Raises :class:`FanOutOverloaded` when it is refused, or when the block raises
        it (no task could start); either way paced.
        """
        caller = caller if self.admission.settings.hold_refusals else None
        if caller is not None:
            caller.arrived(deadline)
        try:
            with self._admission(deadline):
                yield
        except FanOutOverloaded as overloaded:
            self.stats.overloaded += 1
            if not overloaded.retry_after_ms:   # the engine's: no task could start
                overloaded = FanOutOverloaded(str(overloaded), self.admission.retry_after_ms())
            # Paced: the server holds the reply as long as this says (CallerPacing.take_hold).
            if caller is not None and caller.refused(overloaded.retry_after_ms, deadline) > 0:
                self.stats.held += 1
            raise overloaded from None
        except RequiredTaskFailed:
            if caller is not None:
                caller.answered()
            raise
        if caller is not None:
            caller.answered()

    @contextmanager
    def _admission(self, deadline: Deadline) -> Iterator[None]:
        try:
            self.admission.admit(deadline)
        except Refused as refused:
            raise FanOutOverloaded(str(refused), refused.retry_after_ms) from None
        started = time.monotonic()
        try:
            yield
        finally:
            self.admission.done(time.monotonic() - started)

    def refused_unread(self, caller: CallerPacing) -> int:
        """A call refused from its header alone (:mod:`service.overload.shedding`), counted
        and paced: the ``retry_after_ms`` to tell it."""
        retry_after_ms = self.admission.refuse_unread()
        self.stats.overloaded += 1
        if caller.refused_unread(retry_after_ms) > 0:
            self.stats.held += 1
        return retry_after_ms
