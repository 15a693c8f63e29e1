"""A MongoDB backend: one pymongo client, its slots, its guard, its health check.

The client is created with ``connect=False``: nothing touches the network until the
first operation, so start-up never blocks on a MongoDB that is down. TLS and every
other connection option are the URI's (``tls=true&tlsCAFile=...``), as pymongo reads them.
Each operation holds a slot, is ended within its deadline, and runs in a greenlet that
nothing kills (:func:`_run_bounded`); pymongo's errors are made typed by
:mod:`lookups.backends.mongo_errors`.

``connect_timeout_ms`` is pymongo's ``connectTimeoutMS``, and that is all it bounds here:
every operation runs under :func:`pymongo.timeout`, which sets the connect and read
timeouts of the operation's own connection, so only pymongo's monitor uses it, as the
connect and the answer timeout of each server check. A check answered later than that
marks the server unknown and fails every operation in flight, so its default is long (an
engine serving one command at a time, or a stalled event loop, answers late but answers).
An outage is not seen later for it: a server that is down refuses the check at once, and
the health check (:meth:`MongoBackend.check`, a ``ping`` within its own short timeout)
reports a silent one down within a round or two.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import pymongo
from gevent import monkey
from pymongo import monitoring
from pymongo.database import Database
from pymongo.errors import ConfigurationError, PyMongoError, ServerSelectionTimeoutError

from lookups.backends.base import Backend, Slots
from lookups.backends.mongo_errors import MONGO_ERRORS, selection_failed, translated
from lookups.backends.settings import MongoBackendSettings
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BackendUnavailable, blame_own_wait
from lookups.resilience import RetryPolicy
from tracing.context import spawn_in_context

__all__ = ["MongoBackend", "CheckedOutCounter"]

T = TypeVar("T")

_APP_NAME = "fanout"


class MongoBackend(Backend):
    """A MongoDB server, replica set or sharded cluster, as ``settings.uri`` names it.

    Its slots are one fewer than ``pool_size``: the connection left over is the health
    check's ``ping``, which takes no slot. ``event_listeners`` are pymongo's monitoring
    listeners for this client, besides the one counting checked-out connections. Raises
    :class:`ValueError` naming ``uri`` when the URI is not valid (without quoting it: it may
    hold credentials); :class:`~lookups.backends.collection.Backends` says whose.
    """

    kind: ClassVar[str] = "mongo"

    def __init__(
        self,
        name: str,
        settings: MongoBackendSettings,
        policies: Mapping[str, RetryPolicy] = MappingProxyType({}),
        event_listeners: Sequence[Any] = (),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(name, settings, max(1, settings.pool_size - 1), policies, clock)
        self._checked_out = CheckedOutCounter()
        self.client = _open_client(settings, [self._checked_out, *event_listeners])
        # Made once: pymongo builds a new Database (its codec options, read preference
        # and concerns) on every ``client[name]``, and every operation needs it.
        self._db: Database[Any] = self.client[settings.database]
        self._closed = False

    @property
    def db(self) -> Database[Any]:
        """The configured database (``database``)."""
        return self._db

    def run(self, lookup: str, operation: Callable[[Database[Any]], T], deadline: Deadline) -> T:
        """``operation(db)`` for ``lookup``: guarded, retried, ended by ``deadline``."""
        return self.call(lookup, lambda _deadline: operation(self.db), deadline)

    def attempt(self, lookup: str, operation: Callable[[Deadline], T], deadline: Deadline) -> T:
        return _run_bounded(lookup, self.db, self.slots, deadline, lambda: operation(deadline))

    def check(self, timeout_s: float) -> None:
        """A ``ping`` within ``timeout_s``; :class:`~lookups.errors.BackendUnavailable` when
        no server could be selected and pymongo recorded why (refused, reset, unresolvable),
        pymongo's error otherwise. pymongo's server selection looks again every half second,
        so a check of a server that is down may end up to that much past ``timeout_s``."""
        try:
            with pymongo.timeout(timeout_s):
                self.client.admin.command("ping")
        except ServerSelectionTimeoutError:
            failed = selection_failed("health check", self.client)
            if isinstance(failed, BackendUnavailable):
                raise failed from None
            raise

    def connections_in_use(self) -> int:
        return self._checked_out.checked_out

    @property
    def engine_use(self) -> CheckedOutCounter:
        """This client's operations in flight, to find the engine alone (a cache's probes)."""
        return self._checked_out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()


def _open_client(settings: MongoBackendSettings, listeners: list[Any]) -> pymongo.MongoClient[Any]:
    try:
        return pymongo.MongoClient(
            settings.uri,
            connect=False,
            appname=_APP_NAME,
            maxPoolSize=settings.pool_size,
            # No waiting on pymongo's "connecting" limit (default 2): see lookups.backends.base.
            maxConnecting=settings.pool_size,
            connectTimeoutMS=settings.connect_timeout_ms,
            serverSelectionTimeoutMS=settings.server_selection_timeout_ms,
            event_listeners=listeners,
        )
    except (ConfigurationError, ValueError) as exc:  # pymongo raises both for a bad URI
        # The library's message may quote the URI, credentials included.
        raise ValueError(f"uri: not a valid MongoDB URI ({type(exc).__name__})") from None


class CheckedOutCounter(monitoring.ConnectionPoolListener):
    """Counts connections checked out of pymongo's pools (checked out minus checked in):
    the client's operations in flight, the health check's included (an
    :class:`~lookups.cache.plans.EngineUse`).

    Registered on one client through pymongo's official connection-pool monitoring hook.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checked_out = 0
        self._overlaps = 0
        #: Set while no connection is checked out. Setting an event switches to nobody:
        #: its waiters run later, never inside pymongo's pool code.
        self.idle = threading.Event()
        self.idle.set()

    @property
    def checked_out(self) -> int:
        return self._checked_out

    @property
    def overlaps(self) -> int:
        """Connections checked out while another was out, since the client opened."""
        return self._overlaps

    def connection_checked_out(self, event: monitoring.ConnectionCheckedOutEvent) -> None:
        with self._lock:
            self._checked_out += 1
            if self._checked_out > 1:
                self._overlaps += 1
            else:
                self.idle.clear()

    def connection_checked_in(self, event: monitoring.ConnectionCheckedInEvent) -> None:
        with self._lock:
            self._checked_out -= 1
            if self._checked_out <= 0:
                self.idle.set()

    # The remaining pool events carry nothing we count.
    def pool_created(self, event: Any) -> None: ...
    def pool_ready(self, event: Any) -> None: ...
    def pool_cleared(self, event: Any) -> None: ...
    def pool_closed(self, event: Any) -> None: ...
    def connection_created(self, event: Any) -> None: ...
    def connection_ready(self, event: Any) -> None: ...
    def connection_closed(self, event: Any) -> None: ...
    def connection_check_out_started(self, event: Any) -> None: ...
    def connection_check_out_failed(self, event: Any) -> None: ...


# pymongo's server selection looks at its budget only when it wakes: it waits on the
# topology for at most MIN_HEARTBEAT_INTERVAL (a private constant, hence the copy), and
# is woken sooner by its monitor's checks, which keep their own rhythm. While no server is
# available an operation could so run up to that long past its budget.
_SELECTION_STEP_S = 0.5


def _run_bounded(
    lookup: str, db: Database[Any], slots: Slots, deadline: Deadline, operation: Callable[[], T]
) -> T:
    """``operation()`` (pymongo calls on ``db``) with one of ``slots`` held, under
    ``pymongo.timeout``.

    Ends by ``deadline``, or at most a selection step after it: the slot wait is bounded
    by it, and when pymongo already knows that no server is usable (each has a recorded
    error), a server is first selected for ``db``'s read preference (with a ``ping``)
    within whole selection steps; with less than one step left, the error is raised at
    once. The operation itself then gets all the budget that is left: a server
    that came back within the first step (a restart) leaves the query most of its budget.

    pymongo cannot be interrupted safely: an exception thrown into it while it waits on
    one of its locks or conditions corrupts them (``RuntimeError: Semaphore released too
    many times`` in other tasks, connections never checked back in). So, under gevent,
    the operation runs in a greenlet of its own that nothing kills. If the calling task
    is killed, the operation still ends by itself within its budget, gives its
    connection back and releases its slot. Raises what
    :func:`~lookups.backends.mongo_errors.translated` gives,
    and :class:`BackendTimeout` when no slot frees up in time.
    """
    began = deadline.now()
    left_s = deadline.remaining_s()
    if not slots.acquire(timeout=left_s, flow=deadline.flow):
        raise BackendTimeout(
            f"{lookup}: no free MongoDB connection within the budget", backend_fault=False
        )
    waited_s = deadline.now() - began
    call = functools.partial(_run_releasing, lookup, db, slots, deadline, operation)
    if monkey.is_module_patched("threading"):
        succeeded, result = spawn_in_context(call).get()
    else:
        succeeded, result = call()  # plain threads: nothing throws into them
    if not succeeded:
        if isinstance(result, BackendTimeout):
            blame_own_wait(result, waited_s, left_s)
        raise result
    value: T = result
    return value


def _run_releasing(
    lookup: str, db: Database[Any], slots: Slots, deadline: Deadline, operation: Callable[[], T]
) -> tuple[bool, Any]:
    """(True, value) or (False, the exception): a failure is the caller's to raise, not the
    hub's."""
    try:
        _await_usable_server(lookup, db, deadline)
        with pymongo.timeout(_budget_left(lookup, deadline)):
            return True, operation()
    except MONGO_ERRORS as exc:
        error = translated(lookup, exc, db.client)
        error.__cause__ = exc
        return False, error
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it
        return False, exc
    finally:
        slots.release()


def _await_usable_server(lookup: str, db: Database[Any], deadline: Deadline) -> None:
    """When every server has a recorded error, select one within whole selection steps.

    pymongo's server selection looks at its budget only when it wakes: at most a step
    apart, in step with its monitor's checks rather than with this call. It so ends at
    its first wake past the budget it was given, up to a step later; given the time left
    rounded down to whole steps, it ends at most a step past ``deadline``. A shorter wait
    would lose a server that comes back within the budget (a restart). A selection also
    asks the monitors to check now; pymongo does not after an operation's network error
    (the SDAM spec forbids it), so merely watching the topology could wait a whole
    heartbeat interval.
    """
    if not _no_server_usable(db.client):
        return
    steps_s = math.floor(deadline.remaining_s() / _SELECTION_STEP_S) * _SELECTION_STEP_S
    if steps_s <= 0:
        raise selection_failed(lookup, db.client)
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


def _no_server_usable(client: pymongo.MongoClient[Any]) -> bool:
    """Every server has a recorded error (its last check failed): none can be selected now."""
    servers = client.topology_description.server_descriptions().values()
    return bool(servers) and all(server.error is not None for server in servers)
