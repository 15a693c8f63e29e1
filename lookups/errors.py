"""Errors a lookup raises. The fan-out engine turns each into a typed outcome.

    LookupFailed                  the lookup could not produce its panel (ERROR)
     +-- BackendUnavailable       backend down, refused or reset; retry may help
     |    +-- CircuitOpen         the backend's circuit breaker is open: failed at once
     +-- BackendTimeout           backend too slow for the budget (TIMEOUT); retry may help
     +-- BadBackendResponse       backend answered with something unusable; retry will not help

The engine knows nothing of these classes: it reads ``retryable`` and treats any
``TimeoutError`` (``BackendTimeout`` is one) as ``TIMEOUT``.

Two flags, for two audiences:

* ``retryable``: for the caller of the RPC; a later call may well succeed.
* ``retry_safe``: for :mod:`lookups.resilience`; this very attempt failed before the
  backend did any work worth keeping (refused, connect timeout, reset before any
  byte of the answer, HTTP 502/503/504, an error pymongo classes as retryable), so
  trying again within the same task's budget is safe and useful.
"""

from __future__ import annotations

__all__ = [
    "LookupFailed",
    "BackendUnavailable",
    "BackendTimeout",
    "BadBackendResponse",
    "CircuitOpen",
    "blame_own_wait",
]


# A timeout after waiting this share of the budget for our own slot is not the backend's.
_OWN_WAIT_SHARE = 0.1


class LookupFailed(Exception):
    """Base class: the lookup failed. Raised by :meth:`Lookup.fetch`.

    ``retry_safe`` may be given per instance (see the module doc); it defaults to False.
    ``backend_fault`` False says the backend is not to blame (no time was left, or our
    own pool had no slot in time): the circuit breaker does not count it.
    """

    retryable = False
    retry_safe = False

    def __init__(
        self, message: str = "", *, retry_safe: bool = False, backend_fault: bool = True
    ) -> None:
        super().__init__(message)
        self.retry_safe = retry_safe
        self.backend_fault = backend_fault


class BackendUnavailable(LookupFailed):
    """The backend could not be reached (refused, reset, no server selected)."""

    retryable = True


class BackendTimeout(LookupFailed, TimeoutError):
    """The backend did not answer within the task's budget."""

    retryable = True


class BadBackendResponse(LookupFailed):
    """The backend answered, but with an error status or data of the wrong shape."""

    retryable = False


class CircuitOpen(BackendUnavailable):
    """The backend failed so often lately that calls to it fail at once, without a wait."""

    retryable = True


def blame_own_wait(timeout: BackendTimeout, waited_s: float, given_s: float) -> BackendTimeout:
    """``timeout``, no longer counted against the backend if a tenth of the attempt's
    ``given_s`` or more went on waiting for our own pool slot: then our pool was
    saturated, and the time left was short by our doing, not the backend's (whose circuit
    would otherwise open under our own overload). A black hole is still caught: its
    first calls find free slots, time out, and count."""
    if waited_s >= given_s * _OWN_WAIT_SHARE:
        timeout.backend_fault = False
    return timeout
