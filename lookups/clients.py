"""The shared backend clients: one MongoDB client and one HTTP session per process.

Both are pooled and safe to share between greenlets. :meth:`BackendClients.connections_in_use`
counts the connections currently checked out of either pool, so tests can prove that
every lookup, including the ones that failed or timed out, gave its connection back.
"""

from __future__ import annotations

import logging
import threading
from http.cookiejar import DefaultCookiePolicy
from types import MappingProxyType
from typing import Mapping, Union
from urllib.parse import urlsplit

import gevent.lock
import pymongo
import requests
from gevent import monkey
from pymongo import monitoring
from pymongo.database import Database
from pymongo.errors import ConfigurationError
from requests.adapters import HTTPAdapter

from lookups.redact import redact_uri
from tracing.pools import MeteredSlots, PoolMeter
from lookups.resilience import BackendGuard, BreakerPolicy, RetryPolicy
from lookups.settings import HttpSettings, LookupSettings, MongoSettings, bearer_header
from lookups.tls import use_https_settings

__all__ = ["BackendClients", "BackendGuards", "CheckedOutCounter", "HttpSlots", "Slots",
           "new_slots"]

log = logging.getLogger(__name__)

_APP_NAME = "fanout"
# Distinct hosts whose pools the session keeps (alerts and metrics, with room to spare).
_HTTP_HOSTS_CACHED = 8


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
    def pool_created(self, event: monitoring.PoolCreatedEvent) -> None: ...
    def pool_ready(self, event: monitoring.PoolReadyEvent) -> None: ...
    def pool_cleared(self, event: monitoring.PoolClearedEvent) -> None: ...
    def pool_closed(self, event: monitoring.PoolClosedEvent) -> None: ...
    def connection_created(self, event: monitoring.ConnectionCreatedEvent) -> None: ...
    def connection_ready(self, event: monitoring.ConnectionReadyEvent) -> None: ...
    def connection_closed(self, event: monitoring.ConnectionClosedEvent) -> None: ...
    def connection_check_out_started(
            self, event: monitoring.ConnectionCheckOutStartedEvent) -> None: ...
    def connection_check_out_failed(
            self, event: monitoring.ConnectionCheckOutFailedEvent) -> None: ...


Slots = Union[MeteredSlots, gevent.lock.BoundedSemaphore, threading.BoundedSemaphore]


def new_slots(size: int, name: str) -> MeteredSlots:
    """A bounded semaphore of ``size`` for the running concurrency model, metered as ``name``.

    Under gevent's patching (the server), a gevent semaphore: waiting on it is safe to
    interrupt. Without patching (code driving lookups from OS threads), a thread one.
    Either way its use shows in ``fanout pools`` and the ``fanout.pool.*`` metrics.
    """
    if monkey.is_module_patched("threading"):
        return MeteredSlots(gevent.lock.BoundedSemaphore(size), PoolMeter(name, size))
    return MeteredSlots(threading.BoundedSemaphore(size), PoolMeter(name, size))


class HttpSlots:
    """At most ``per_origin`` HTTP calls in flight to each origin (scheme, host and port).

    HTTP lookups take a slot before calling, so urllib3's own pool (as big) always has a
    connection ready and never makes a caller wait. Its wait is a ``threading.Condition``,
    which a ``gevent.Timeout`` (the lookup's whole-exchange timer) or a kill arriving
    mid-wait leaves corrupted (urllib3 then raises ``FullPoolError``); waiting on a gevent
    semaphore instead is safe to interrupt.
    """

    def __init__(self, per_origin: int) -> None:
        self._per_origin = per_origin
        self._slots: dict[tuple[str, str], MeteredSlots] = {}

    def for_url(self, url: str) -> MeteredSlots:
        """The semaphore of ``url``'s origin."""
        parts = urlsplit(url)
        origin = (parts.scheme, parts.netloc)
        slot = self._slots.get(origin)
        if slot is None:
            slot = self._slots[origin] = new_slots(self._per_origin, f"http {parts.netloc}")
        return slot

    def meters(self) -> list[PoolMeter]:
        """The meters of the origins called so far."""
        return [slot.meter for slot in self._slots.values()]


class BackendGuards:
    """A :class:`~lookups.resilience.BackendGuard` for MongoDB and one per HTTP origin.

    Each gets its backend's retry budget and breaker settings; ``policies`` gives each
    lookup's attempts and hedging (``[lookups.<name>]``).
    """

    def __init__(self, mongo: MongoSettings, http: HttpSettings,
                 policies: Mapping[str, LookupSettings]) -> None:
        self._http_settings = http
        self._policies = {name: RetryPolicy(p.attempts, p.hedge) for name, p in policies.items()}
        self.mongo = BackendGuard("mongo", _breaker_policy(mongo), mongo.retry_budget_ratio,
                                  self._policies)
        self._http: dict[str, BackendGuard] = {}

    def for_url(self, url: str) -> BackendGuard:
        """The guard of ``url``'s origin (scheme, host and port)."""
        origin = urlsplit(url).netloc
        guard = self._http.get(origin)
        if guard is None:
            guard = self._http[origin] = BackendGuard(
                f"http {origin}", _breaker_policy(self._http_settings),
                self._http_settings.retry_budget_ratio, self._policies)
        return guard

    def all(self) -> list[BackendGuard]:
        return [self.mongo, *self._http.values()]


def _breaker_policy(settings: MongoSettings | HttpSettings) -> BreakerPolicy:
    return BreakerPolicy(consecutive_failures=settings.breaker_failures,
                         failure_rate=settings.breaker_failure_rate,
                         open_ms=settings.breaker_open_ms)


class BackendClients:
    """The process's shared backend clients, built from their settings sections.

    The MongoDB client is created with ``connect=False``: nothing touches the network
    until the first operation, so start-up never blocks on a MongoDB that is down.
    The HTTP session ignores proxy and netrc environment variables
    (``trust_env = False``): configuration arrives only through the settings.

    With ``http.auth_token`` set, every HTTP lookup sends ``Authorization: Bearer <token>``.

    With ``http.ca_file`` or a client certificate set, HTTPS uses them (:mod:`lookups.tls`).

    Raises :class:`ValueError` naming ``mongo.uri`` when it is not a valid MongoDB URI
    (the message does not repeat it, as it may hold credentials), or the HTTPS file
    that does not load.
    """

    def __init__(self, mongo: MongoSettings, http: HttpSettings,
                 lookups: Mapping[str, LookupSettings] = MappingProxyType({})) -> None:
        authorization = bearer_header(http)
        self._mongo_settings = mongo
        self._http_settings = http
        self._mongo_checked_out = CheckedOutCounter()
        self._client = _open_mongo_client(mongo, self._mongo_checked_out)
        self._adapter = HTTPAdapter(pool_connections=_HTTP_HOSTS_CACHED, pool_maxsize=http.pool_maxsize,
                                    pool_block=True, max_retries=0)
        self._session = requests.Session()
        self._session.trust_env = False
        # Lookups send no cookies (see HttpLookup._prepare): keep none either, so that a
        # backend setting new ones on every answer cannot grow the jar.
        self._session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        if authorization:
            self._session.headers["Authorization"] = authorization
        self._session.mount("http://", self._adapter)
        self._session.mount("https://", self._adapter)
        use_https_settings(self._session, http)
        self._http_slots = HttpSlots(http.pool_maxsize)
        # One connection is left over for the health check's ping, which takes no slot.
        self._mongo_slots = new_slots(max(1, mongo.max_pool_size - 1), "mongo")
        self.guards = BackendGuards(mongo, http, lookups)
        self._closed = False
        log.debug("backends: MongoDB %s (database %s), alerts %s, metrics %s, bearer token %s",
                  redact_uri(mongo.uri), mongo.database, redact_uri(http.alerts_url),
                  redact_uri(http.metrics_url), "set" if http.auth_token else "not set")

    @property
    def mongo_settings(self) -> MongoSettings:
        return self._mongo_settings

    @property
    def http_settings(self) -> HttpSettings:
        return self._http_settings

    @property
    def mongo_client(self) -> pymongo.MongoClient:
        return self._client

    @property
    def db(self) -> Database:
        """The configured database (``mongo.database``)."""
        return self._client[self._mongo_settings.database]

    @property
    def session(self) -> requests.Session:
        """The shared HTTP session; its pools block when ``http.pool_maxsize`` are in use."""
        return self._session

    @property
    def mongo_slots(self) -> MeteredSlots:
        """MongoDB operations a lookup may have in flight: one fewer than ``mongo.max_pool_size``.

        Lookups take a slot before calling pymongo, so pymongo's pool always has a
        connection for them and never makes them wait. Its waits are ``threading.Condition``
        waits, which an exception arriving mid-wait (a killed task) leaves corrupted:
        pymongo then raises ``RuntimeError: Semaphore released too many times`` in other
        tasks and loses track of checked-out connections. A gevent semaphore is safe.
        """
        return self._mongo_slots

    @property
    def http_slots(self) -> HttpSlots:
        """The per-origin bound HTTP lookups take a slot of before calling."""
        return self._http_slots

    def pool_meters(self) -> list[PoolMeter]:
        """The backend pools' meters: MongoDB's, then each HTTP origin's called so far."""
        return [self._mongo_slots.meter, *self._http_slots.meters()]

    def connections_in_use(self) -> dict[str, int]:
        """Connections checked out right now: ``{"mongo": n, "http": m}``."""
        return {"mongo": self._mongo_checked_out.checked_out,
                "http": _http_connections_in_use(self._adapter)}

    def close(self) -> None:
        """Close both clients; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.close()
        self._client.close()

    def __enter__(self) -> "BackendClients":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _open_mongo_client(settings: MongoSettings,
                       listener: CheckedOutCounter) -> pymongo.MongoClient:
    try:
        return pymongo.MongoClient(
            settings.uri, connect=False, appname=_APP_NAME,
            maxPoolSize=settings.max_pool_size,
            # No waiting on pymongo's "connecting" limit (default 2): see mongo_slots.
            maxConnecting=settings.max_pool_size,
            connectTimeoutMS=settings.connect_timeout_ms,
            serverSelectionTimeoutMS=settings.server_selection_timeout_ms,
            event_listeners=[listener])
    except ConfigurationError as exc:
        # The library's message may quote the URI, credentials included.
        raise ValueError(f"mongo.uri: not a valid MongoDB URI ({type(exc).__name__})") from None


def _http_connections_in_use(adapter: HTTPAdapter) -> int:
    """Sum over the adapter's urllib3 pools of connections not sitting in their queue.

    A urllib3 pool's queue starts full (``maxsize`` placeholders); each checkout takes
    one entry out and each release puts one back, so ``maxsize - qsize`` are in use.
    """
    in_use = 0
    pools = adapter.poolmanager.pools
    for key in list(pools.keys()):
        pool = pools.get(key)
        queue = getattr(pool, "pool", None) if pool is not None else None
        if queue is not None:
            in_use += queue.maxsize - queue.qsize()
    return in_use
