"""Errors a lookup raises. The fan-out engine turns each into a typed outcome.

    LookupFailed                  the lookup could not produce its panel (ERROR)
     +-- BackendUnavailable       backend down, refused or reset; retry may help
     +-- BackendTimeout           backend too slow for the budget (TIMEOUT); retry may help
     +-- BadBackendResponse       backend answered with something unusable; retry will not help

The engine knows nothing of these classes: it reads ``retryable`` and treats any
``TimeoutError`` (``BackendTimeout`` is one) as ``TIMEOUT``.
"""

from __future__ import annotations

__all__ = ["LookupFailed", "BackendUnavailable", "BackendTimeout", "BadBackendResponse"]


class LookupFailed(Exception):
    """Base class: the lookup failed. Raised by :meth:`Lookup.fetch`."""

    retryable = False


class BackendUnavailable(LookupFailed):
    """The backend could not be reached (refused, reset, no server selected)."""

    retryable = True


class BackendTimeout(LookupFailed, TimeoutError):
    """The backend did not answer within the task's budget."""

    retryable = True


class BadBackendResponse(LookupFailed):
    """The backend answered, but with an error status or data of the wrong shape."""

    retryable = False
