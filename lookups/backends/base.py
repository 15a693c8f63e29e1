"""What every backend is: a name, slots that bound its calls, a guard, a health check.

:meth:`Backend.call` is the one place where a lookup's call meets its backend:
the guard (circuit breaker, retries within the budget, hedging) runs attempts,
and each attempt holds one of the backend's slots while it runs::

    guard.call -> attempt: slot, then the library call, then the slot back

The slots are our own (:class:`~lookups.backends.ordered_slots.OrderedSlots`, served
by the calls' places rather than their arrival), as big as the library's pool, so the
library's pool always has a connection ready and never makes a caller wait: its
waits are ``threading.Condition`` waits, which a ``gevent.Timeout`` or a kill
arriving mid-wait leaves corrupted (pymongo then raises ``RuntimeError: Semaphore
released too many times`` in other tasks; urllib3 ``FullPoolError``). Waiting on our
own slots instead is safe to interrupt. Subclasses say how one attempt holds
its slot (:meth:`Backend.attempt`) and how the backend is checked (:meth:`Backend.check`).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from gevent import monkey

from lookups.backends.ordered_slots import OrderedSlots
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.flow import NO_FLOW, Flow
from lookups.resilience import BackendGuard, BreakerPolicy, RetryPolicy
from tracing.pools import MeteredSlots, PoolMeter

__all__ = ["Backend", "Slots", "ThreadSlots", "new_slots"]

T = TypeVar("T")


class ThreadSlots(threading.BoundedSemaphore):
    """A thread semaphore with :class:`OrderedSlots`' ``acquire``: its waiters' places
    (``flow``) are not kept, they are served as the threads wake."""

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, flow: Flow = NO_FLOW
    ) -> bool:
        return super().acquire(blocking, timeout)


Slots = MeteredSlots | OrderedSlots | ThreadSlots


def new_slots(size: int, name: str, clock: Clock = SYSTEM_CLOCK) -> MeteredSlots:
    """``size`` slots for the running concurrency model, metered as ``name``.

    Under gevent's patching (the server), :class:`OrderedSlots`: waiting on them is safe to
    interrupt, and served by place. Without patching (code driving lookups from OS
    threads), a thread semaphore.
    Either way its use shows in ``fanout pools`` and the ``fanout.pool.*`` metrics.
    """
    if monkey.is_module_patched("threading"):
        semaphore: Any = OrderedSlots(size, clock)
    else:
        semaphore = ThreadSlots(size)
    return MeteredSlots(semaphore, PoolMeter(name, size, clock=clock))


class Backend(abc.ABC):
    """One backend: its ``name`` (what metrics, health and pool reports call it), its
    ``slots``, its ``guard``, and its clients.

    ``settings`` is its ``[backends.<name>]`` table; ``policies`` each lookup's attempts
    and hedging (``[lookups.<name>]``); ``clock`` the service's (:mod:`lookups.clock`).
    """

    kind: ClassVar[str]

    def __init__(
        self,
        name: str,
        settings: Any,
        slot_count: int,
        policies: Mapping[str, RetryPolicy],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.name = name
        self.settings = settings
        self.clock = clock
        self.slots = new_slots(slot_count, name, clock)
        self.guard = BackendGuard(
            name,
            BreakerPolicy(
                consecutive_failures=settings.breaker_failures,
                failure_rate=settings.breaker_failure_rate,
                open_ms=settings.breaker_open_ms,
            ),
            settings.retry_budget_ratio,
            policies,
            clock,
        )

    def call(self, lookup: str, attempt: Callable[[Deadline], T], deadline: Deadline) -> T:
        """``attempt(deadline)`` for ``lookup`` through the guard, each try holding a slot.

        Raises :class:`~lookups.errors.LookupFailed` (typed) when every try failed, or
        :class:`~lookups.errors.CircuitOpen` at once while the circuit is open.
        """
        result: T = self.guard.call(
            lookup,
            lambda attempt_deadline: self.attempt(lookup, attempt, attempt_deadline),
            deadline,
        )
        return result

    @abc.abstractmethod
    def attempt(self, lookup: str, operation: Callable[[Deadline], T], deadline: Deadline) -> T:
        """One try of ``operation(deadline)`` holding a slot, ended by ``deadline``."""

    @abc.abstractmethod
    def check(self, timeout_s: float) -> None:
        """Raise if the backend does not answer its health check within ``timeout_s``."""

    @abc.abstractmethod
    def connections_in_use(self) -> int:
        """Connections checked out of the library's pool right now."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the backend's clients; idempotent."""

    @property
    def meter(self) -> PoolMeter:
        """The slots' meter: ``fanout pools`` and the ``fanout.pool.*`` metrics."""
        return self.slots.meter

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
