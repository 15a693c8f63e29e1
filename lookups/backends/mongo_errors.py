"""What a MongoDB lookup reports when pymongo fails, and why; consulted only on a failure::

    server refused, reset, closed, unresolvable        BackendUnavailable (retryable; a failed
                                                       connection is retry_safe)
    no answer within the budget                        BackendTimeout (retryable)
    pymongo's monitor could not reach the server in
      time, and cancelled the operation                BackendTimeout: slow, not known down
    garbled wire message (ProtocolError)               BadBackendResponse, retry_safe: pymongo
                                                       closed that connection
    command failed, bad BSON                           BadBackendResponse (not retryable)

Messages name the panel and the pymongo error class, never the URI (it may hold
credentials) nor pymongo's own message (it lists hosts and options).
"""

from __future__ import annotations

from typing import Any

import pymongo
from bson.errors import BSONError
from pymongo.errors import (
    ConnectionFailure,
    OperationFailure,
    ProtocolError,
    PyMongoError,
    ServerSelectionTimeoutError,
)

from lookups.errors import BackendTimeout, BackendUnavailable, BadBackendResponse, LookupFailed

__all__ = ["translated", "selection_failed", "MONGO_ERRORS", "MONITOR_CUT"]

#: What :func:`translated` turns into :mod:`lookups.errors`.
MONGO_ERRORS = (PyMongoError, BSONError)
#: What a panel's error says when pymongo failed it because its monitor's check timed out
#: (the bench counts the replies that carry it).
MONITOR_CUT = "too slow to answer its monitor"


def selection_failed(lookup: str, client: pymongo.MongoClient[Any]) -> LookupFailed:
    if _server_known_down(client):
        return BackendUnavailable(f"{lookup}: no MongoDB server available")
    return BackendTimeout(f"{lookup}: no MongoDB server answered within the budget")


def translated(lookup: str, exc: Exception, client: pymongo.MongoClient[Any]) -> LookupFailed:
    """``exc`` (a pymongo or BSON error) as one of :mod:`lookups.errors`, free of the URI.

    Server selection failing is reported as :class:`BackendUnavailable` when pymongo
    recorded why the server is unusable (refused, reset, unresolvable): calling that a
    timeout would send an operator looking for a slow server when the server is down.
    When it recorded only timeouts, or nothing, selection ran out of budget waiting for a
    slow server: :class:`BackendTimeout`.
    """
    if isinstance(exc, ServerSelectionTimeoutError):
        return selection_failed(lookup, client)
    if isinstance(exc, BSONError):
        return BadBackendResponse(f"{lookup}: MongoDB sent undecodable BSON")
    kind = type(exc).__name__
    if getattr(exc, "timeout", False):
        return BackendTimeout(f"{lookup}: MongoDB did not answer within the budget ({kind})")
    if isinstance(exc, ConnectionFailure):
        if _server_only_slow(client):
            # The monitor's heartbeat timed out, so pymongo cancelled the operations in flight.
            return BackendTimeout(f"{lookup}: MongoDB {MONITOR_CUT} ({kind})")
        # A connection that failed (reset, closed: a restarted server) is what pymongo's
        # retryable reads retry; a fresh attempt takes a fresh connection.
        return BackendUnavailable(f"{lookup}: MongoDB connection failed ({kind})", retry_safe=True)
    if isinstance(exc, ProtocolError):
        # pymongo closes a connection whose reply it cannot read (a stream out of step, a
        # bad header): the read failed on that connection, not in the server's query, so
        # another attempt on a fresh one may well succeed.
        return BadBackendResponse(f"{lookup}: MongoDB garbled its answer ({kind})", retry_safe=True)
    if isinstance(exc, OperationFailure):
        code = getattr(exc, "code", None)
        return BadBackendResponse(
            f"{lookup}: MongoDB refused the aggregation (code {code}, {kind})"
        )
    return LookupFailed(f"{lookup}: MongoDB client error ({kind})")


def _recorded_errors(client: pymongo.MongoClient[Any]) -> list[Exception]:
    servers = client.topology_description.server_descriptions().values()
    return [server.error for server in servers if server.error is not None]


def _is_timeout(error: Exception) -> bool:
    return bool(getattr(error, "timeout", False))


def _server_known_down(client: pymongo.MongoClient[Any]) -> bool:
    """pymongo recorded a reason other than slowness (refused, reset, unresolvable)."""
    return any(not _is_timeout(error) for error in _recorded_errors(client))


def _server_only_slow(client: pymongo.MongoClient[Any]) -> bool:
    """pymongo recorded errors, and every one is a timeout."""
    errors = _recorded_errors(client)
    return bool(errors) and all(_is_timeout(error) for error in errors)
