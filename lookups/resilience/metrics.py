"""The resilience metrics, per backend (``fanout.backend`` = the backend's name: ``mongo``, ``alerts``, ...)::

    fanout.circuit.state       gauge    0 closed, 1 half open, 2 open
    fanout.circuit.opened      counter  times the circuit opened
    fanout.backend.attempts    counter  attempts made (first tries, retries and hedges)
    fanout.backend.retries     counter  retries the retry budget allowed
    fanout.backend.retries_refused  counter  retries the retry budget refused
    fanout.backend.hedges      counter  hedged second attempts sent

Read from the guards when a reader collects; nothing on the hot path.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from lookups.resilience.breaker import CircuitState

__all__ = ["metered", "live_guards"]

# Every BackendGuard alive (lookups.resilience.guard), which registers itself here.
_guards: "weakref.WeakSet[Any]" = weakref.WeakSet()


def metered(guard: Any) -> None:
    """Report ``guard`` (a BackendGuard) in these metrics while it is alive."""
    _guards.add(guard)


def live_guards() -> list[Any]:
    """Every backend guard alive in this process, by name."""
    return sorted(_guards, key=lambda guard: guard.name)

_STATE_VALUE = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}


def _per_guard(value: Callable[[Any], Any]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value(guard), {"fanout.backend": guard.name}) for guard in live_guards()]
    return callback


_meter = metrics.get_meter("fanout.lookups")
_meter.create_observable_gauge("fanout.circuit.state",
                               [_per_guard(lambda g: _STATE_VALUE[g.breaker.state])],
                               unit="{state}",
                               description="Circuit breaker: 0 closed, 1 half open, 2 open")
for _name, _read, _unit, _description in (
        ("fanout.circuit.opened", lambda g: g.breaker.opened, "{opening}", "Times the circuit opened"),
        ("fanout.backend.attempts", lambda g: g.attempts, "{attempt}",
         "Attempts made, retries and hedges included"),
        ("fanout.backend.retries", lambda g: g.budget.retries, "{attempt}",
         "Retries and hedges the budget allowed"),
        ("fanout.backend.retries_refused", lambda g: g.budget.refused, "{attempt}",
         "Retries the budget refused"),
        ("fanout.backend.hedges", lambda g: g.hedges, "{attempt}", "Hedged second attempts sent")):
    _meter.create_observable_counter(_name, [_per_guard(_read)], unit=_unit, description=_description)
