"""A MongoDB backend: one pymongo client, its slots, its guard, its health check.

The client is created with ``connect=False``: nothing touches the network until the
first operation, so start-up never blocks on a MongoDB that is down. TLS and every
other connection option are the URI's (``tls=true&tlsCAFile=...``), as pymongo reads them.
Each operation runs through :mod:`lookups.backends.mongo_executor`.
"""

from __future__ import annotations

import threading
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

import pymongo
from pymongo import monitoring
from pymongo.database import Database
from pymongo.errors import ConfigurationError

from lookups.backends.base import Backend
from lookups.backends.mongo_executor import run_bounded
from lookups.backends.settings import MongoBackendSettings
from lookups.resilience import RetryPolicy
from lookups.deadline import Deadline

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

    def __init__(self, name: str, settings: MongoBackendSettings,
                 policies: Mapping[str, RetryPolicy] = MappingProxyType({}),
                 event_listeners: Sequence[Any] = ()) -> None:
        super().__init__(name, settings, max(1, settings.pool_size - 1), policies)
        self._checked_out = CheckedOutCounter()
        self.client = _open_client(settings, [self._checked_out, *event_listeners])
        self._closed = False

    @property
    def db(self) -> Database:
        """The configured database (``database``)."""
        return self.client[self.settings.database]

    def run(self, lookup: str, operation: Callable[[Database], T], deadline: Deadline) -> T:
        """``operation(db)`` for ``lookup``: guarded, retried, ended by ``deadline``."""
        return self.call(lookup, lambda _deadline: operation(self.db), deadline)

    def attempt(self, lookup: str, operation: Callable[[Deadline], T], deadline: Deadline) -> T:
        return run_bounded(lookup, self.db, self.slots, deadline, lambda: operation(deadline))

    def check(self, timeout_s: float) -> None:
        with pymongo.timeout(timeout_s):
            self.client.admin.command("ping")

    def connections_in_use(self) -> int:
        return self._checked_out.checked_out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()


def _open_client(settings: MongoBackendSettings, listeners: list[Any]) -> pymongo.MongoClient:
    try:
        return pymongo.MongoClient(
            settings.uri, connect=False, appname=_APP_NAME,
            maxPoolSize=settings.pool_size,
            # No waiting on pymongo's "connecting" limit (default 2): see lookups.backends.base.
            maxConnecting=settings.pool_size,
            connectTimeoutMS=settings.connect_timeout_ms,
            serverSelectionTimeoutMS=settings.server_selection_timeout_ms,
            event_listeners=listeners)
    except (ConfigurationError, ValueError) as exc:  # pymongo raises both for a bad URI
        # The library's message may quote the URI, credentials included.
        raise ValueError(f"uri: not a valid MongoDB URI "
                         f"({type(exc).__name__})") from None


class CheckedOutCounter(monitoring.ConnectionPoolListener):
    """Counts connections checked out of pymongo's pools (checked out minus checked in).

    Registered on one client through pymongo's official connection-pool monitoring hook.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checked_out = 0

    @property
    def checked_out(self) -> int:
        return self._checked_out

    def connection_checked_out(self, event: monitoring.ConnectionCheckedOutEvent) -> None:
        with self._lock:
            self._checked_out += 1

    def connection_checked_in(self, event: monitoring.ConnectionCheckedInEvent) -> None:
        with self._lock:
            self._checked_out -= 1

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
