"""The MongoDB executor: one operation, holding a slot, ended within its budget, in a
greenlet nothing kills, with pymongo's errors made typed.

What a MongoDB lookup reports, and why::

    server refused, reset, closed, unresolvable        BackendUnavailable (retryable; a failed
                                                       connection is retry_safe)
    no answer within the budget                        BackendTimeout (retryable)
    pymongo's monitor could not reach the server in
      time, and cancelled the operation                BackendTimeout: slow, not known down
    command failed, bad wire message, bad BSON         BadBackendResponse (not retryable)

Messages name the panel and the pymongo error class, never the URI (it may hold
credentials) nor pymongo's own message (it lists hosts and options).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any, Callable, Iterator, TypeVar

import pymongo
from bson.errors import BSONError
from gevent import monkey
from pymongo.database import Database
from pymongo.errors import (ConnectionFailure, OperationFailure, ProtocolError, PyMongoError,
                            ServerSelectionTimeoutError)

from lookups.backends.base import Slots
from lookups.deadline import Deadline
from lookups.errors import (BackendTimeout, BackendUnavailable, BadBackendResponse, LookupFailed,
                            blame_own_wait)
from tracing.greenlets import spawn_in_context

__all__ = ["run_bounded", "translated_errors"]

T = TypeVar("T")

# pymongo's server selection looks at its budget only every half second: it waits on the
# topology in MIN_HEARTBEAT_INTERVAL steps (a private constant, hence the copy). While no
# server is available an operation could so run up to that long past its budget.
_SELECTION_STEP_S = 0.5


def run_bounded(lookup: str, db: Database, slots: Slots, deadline: Deadline,
                operation: Callable[[], T]) -> T:
    """``operation()`` (pymongo calls on ``db``) with one of ``slots`` held, under ``pymongo.timeout``.

    Ends by ``deadline``: the slot wait is bounded by it, and when pymongo already
    knows that no server is usable (each has a recorded error), a server is first
    selected for ``db``'s read preference (with a ``ping``) within whole selection steps,
    so that waiting for a server ends in time; with less than one step left, the error is
    raised at once. The operation itself then gets all the budget that is left: a server
    that came back within the first step (a restart) leaves the query most of its budget.

    pymongo cannot be interrupted safely: an exception thrown into it while it waits on
    one of its locks or conditions corrupts them (``RuntimeError: Semaphore released too
    many times`` in other tasks, connections never checked back in). So, under gevent,
    the operation runs in a greenlet of its own that nothing kills. If the calling task
    is killed, the operation still ends by itself within its budget, gives its
    connection back and releases its slot. Raises what :func:`translated_errors` raises,
    and :class:`BackendTimeout` when no slot frees up in time.
    """
    began = time.monotonic()
    left_s = deadline.remaining_s()
    if not slots.acquire(timeout=left_s):
        raise BackendTimeout(f"{lookup}: no free MongoDB connection within the budget",
                             backend_fault=False)
    waited_s = time.monotonic() - began
    call = functools.partial(_run_releasing, lookup, db, slots, deadline, operation)
    if monkey.is_module_patched("threading"):
        succeeded, result = spawn_in_context(call).get()
    else:
        succeeded, result = call()  # plain threads: nothing throws into them
    if not succeeded:
        if isinstance(result, BackendTimeout):
            blame_own_wait(result, waited_s, left_s)
        raise result
    return result


def _run_releasing(lookup: str, db: Database, slots: Slots, deadline: Deadline,
                   operation: Callable[[], T]) -> tuple[bool, Any]:
    """(True, value) or (False, the exception): a failure is the caller's to raise, not the hub's."""
    try:
        with translated_errors(lookup, db.client):
            _await_usable_server(lookup, db, deadline)
            with pymongo.timeout(_budget_left(lookup, deadline)):
                return True, operation()
    except Exception as exc:  # handed to the caller, which raises it
        return False, exc
    finally:
        slots.release()


def _await_usable_server(lookup: str, db: Database, deadline: Deadline) -> None:
    """When every server has a recorded error, select one within whole selection steps.

    pymongo's server selection looks at its budget only between waits of up to a step, so
    a budget of whole steps keeps it from running on past ``deadline``. A selection also
    asks the monitors to check now; pymongo does not after an operation's network error
    (the SDAM spec forbids it), so merely watching the topology could wait a whole
    heartbeat interval.
    """
    if not _no_server_usable(db.client):
        return
    steps_s = math.floor(deadline.remaining_s() / _SELECTION_STEP_S) * _SELECTION_STEP_S
    if steps_s <= 0:
        raise _selection_failed(lookup, db.client)
    try:
        with pymongo.timeout(steps_s):
            db.command("ping", read_preference=db.read_preference)
    except PyMongoError as exc:
        if not exc.timeout or _no_server_usable(db.client):
            raise
        # A server was selected but its answer was slow (queued behind other work):
        # the operation still has the rest of the budget.


def _budget_left(lookup: str, deadline: Deadline) -> float:
    """Seconds left for pymongo's ``timeout()``; none left is a timeout of ours."""
    left_s = deadline.remaining_s()
    if left_s <= 0:
        raise BackendTimeout(f"{lookup}: no time left to query MongoDB", backend_fault=False)
    return left_s


@contextlib.contextmanager
def translated_errors(lookup: str, client: pymongo.MongoClient) -> Iterator[None]:
    """Re-raise pymongo's errors as :mod:`lookups.errors`, with messages free of the URI.

    Server selection failing is reported as :class:`BackendUnavailable` when pymongo
    recorded why the server is unusable (refused, reset, unresolvable): calling that a
    timeout would send an operator looking for a slow server when the server is down.
    When it recorded only timeouts, or nothing, selection ran out of budget waiting for a
    slow server: :class:`BackendTimeout`.
    """
    try:
        yield
    except ServerSelectionTimeoutError as exc:
        raise _selection_failed(lookup, client) from exc
    except PyMongoError as exc:
        raise _translated(lookup, exc, client) from exc
    except BSONError as exc:
        raise BadBackendResponse(f"{lookup}: MongoDB sent undecodable BSON") from exc


def _selection_failed(lookup: str, client: pymongo.MongoClient) -> LookupFailed:
    if _server_known_down(client):
        return BackendUnavailable(f"{lookup}: no MongoDB server available")
    return BackendTimeout(f"{lookup}: no MongoDB server answered within the budget")


def _translated(lookup: str, exc: PyMongoError, client: pymongo.MongoClient) -> LookupFailed:
    kind = type(exc).__name__
    if exc.timeout:
        return BackendTimeout(f"{lookup}: MongoDB did not answer within the budget ({kind})")
    if isinstance(exc, ConnectionFailure):
        if _server_only_slow(client):
            # The monitor's heartbeat timed out, so pymongo cancelled the operations in flight.
            return BackendTimeout(f"{lookup}: MongoDB too slow to answer its monitor ({kind})")
        # A connection that failed (reset, closed: a restarted server) is what pymongo's
        # retryable reads retry; a fresh attempt takes a fresh connection.
        return BackendUnavailable(f"{lookup}: MongoDB connection failed ({kind})", retry_safe=True)
    if isinstance(exc, (OperationFailure, ProtocolError)):
        code = getattr(exc, "code", None)
        return BadBackendResponse(f"{lookup}: MongoDB refused or garbled the aggregation "
                                  f"(code {code}, {kind})")
    return LookupFailed(f"{lookup}: MongoDB client error ({kind})")


def _recorded_errors(client: pymongo.MongoClient) -> list[Exception]:
    servers = client.topology_description.server_descriptions().values()
    return [server.error for server in servers if server.error is not None]


def _is_timeout(error: Exception) -> bool:
    return bool(getattr(error, "timeout", False))


def _server_known_down(client: pymongo.MongoClient) -> bool:
    """pymongo recorded a reason other than slowness (refused, reset, unresolvable)."""
    return any(not _is_timeout(error) for error in _recorded_errors(client))


def _no_server_usable(client: pymongo.MongoClient) -> bool:
    """Every server has a recorded error (its last check failed): none can be selected now."""
    servers = client.topology_description.server_descriptions().values()
    return bool(servers) and all(server.error is not None for server in servers)


def _server_only_slow(client: pymongo.MongoClient) -> bool:
    """pymongo recorded errors, and every one is a timeout."""
    errors = _recorded_errors(client)
    return bool(errors) and all(_is_timeout(error) for error in errors)
