"""Backend health for load balancers: can this server reach each backend right now?

One check per backend (:meth:`lookups.backends.base.Backend.check`), run in
parallel, each bounded by its own short timeout (``timeout_ms``, 300 ms by default):

* a MongoDB backend (``mongo``): a ``ping`` command through its client;
* an HTTP backend (``alerts``, ``metrics``, a plugin's): a ``GET`` of its base URL
  (or ``health_path`` under it) on a small session of its own (so a full lookup pool
  cannot delay the check). A ``2xx`` or ``3xx`` answer means the service is up,
  whatever its body; a ``404`` means something else answers at that URL.

A server checks every :data:`CHECK_INTERVAL_S` whatever its traffic
(:meth:`HealthChecker.watch`). The answer is cached for ``cache_ms`` (1 s by
default), and concurrent callers share one refresh, so a load balancer polling
many times a second costs the backends at most one round of checks per second.
The checks are not traced. In a pre-forked group the master checks, and every
worker reports the master's rounds (:meth:`HealthChecker.follow`).

``detail`` is written here from the failure's kind (never from a library's
message, which may quote a URI with credentials): for example
``"no answer within 300 ms (ServerSelectionTimeoutError)"``, ``"cannot connect (...)"``
(refused, reset, unresolvable) or ``"HTTP 503"``.

The HTTP probes that report it are in :mod:`service.operations.probes`; the last round of
checks is also the ``fanout.backend.up`` gauge (1 up, 0 down, per backend).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import gevent
import gevent.lock
import requests
from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from lookups.backends.collection import Backends
from lookups.backends.http import HttpStatusError
from lookups.cache.stores import BucketStore
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.errors import BackendUnavailable
from tracing.context import spawn_in_context

__all__ = [
    "BackendStatus",
    "HealthChecker",
    "CACHE_STORE",
    "store_statuses",
    "DEFAULT_CHECK_TIMEOUT_MS",
    "DEFAULT_CACHE_MS",
    "CHECK_INTERVAL_S",
]

log = logging.getLogger(__name__)

DEFAULT_CHECK_TIMEOUT_MS = 300
#: How often a server checks its backends whatever the traffic (:meth:`HealthChecker.watch`).
CHECK_INTERVAL_S = 2.0
DEFAULT_CACHE_MS = 1000
#: How long past its timeout a round waits for a check: pymongo's server selection looks
#: again only every half second (``MIN_HEARTBEAT_INTERVAL``), so a check of a MongoDB
#: server that is down ends up to that much past its timeout, with the reason pymongo found.
_JOIN_MARGIN_S = 0.6


@dataclass(frozen=True)
class BackendStatus:
    """One backend as last checked: ``detail`` says why it is down, empty when up."""

    name: str
    up: bool
    latency_ms: float
    detail: str = ""
    circuit: str = (
        "closed"  # the backend's circuit breaker, as lookups see it: closed, open, half_open
    )


#: The name the results cache's shared store (Redis) goes by beside the backends.
CACHE_STORE = "cache"


def store_statuses(store: BucketStore | None, shared: bool) -> tuple[BackendStatus, ...]:
    """The results cache's shared store, to report beside the backends: up or down as its
    last command found it (calls use it, so no check of its own), its circuit ``open``
    while the cache leaves it alone after a failure. Nothing for a cache in process."""
    if store is None or not shared:
        return ()
    up = bool(store.stats.store_up)
    detail = "" if up else "Redis did not answer the cache's last command"
    circuit = "closed" if store.available() else "open"
    return (BackendStatus(CACHE_STORE, up, 0.0, detail, circuit),)


class HealthChecker:
    """Checks every backend of one :class:`~lookups.backends.collection.Backends`, cached briefly.

    :meth:`check` never raises for a backend failure: that backend is reported
    down. ``clock`` is the service's (:mod:`lookups.clock`).
    """

    def __init__(
        self,
        backends: Backends,
        *,
        timeout_ms: int = DEFAULT_CHECK_TIMEOUT_MS,
        cache_ms: int = DEFAULT_CACHE_MS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._timeout_s = timeout_ms / 1000.0
        self._cache_s = cache_ms / 1000.0
        self._clock = clock
        self._lock = gevent.lock.Semaphore()
        self._cached: tuple[BackendStatus, ...] | None = None
        self._answer: tuple[Any, tuple[str, ...], tuple[BackendStatus, ...]] | None = None
        self._checked_at = 0.0
        self._probes: tuple[tuple[str, Callable[[], None]], ...] = tuple(
            (backend.name, functools.partial(backend.check, self._timeout_s))
            for backend in backends
        )
        self._breakers = tuple(backend.guard.breaker for backend in backends)
        self._following: tuple[BackendStatus, ...] | None = None
        self._running: dict[str, gevent.Greenlet] = {}
        self._watcher: gevent.Greenlet | None = None

    def following(self) -> tuple[BackendStatus, ...] | None:
        """The statuses given by :meth:`follow`, or ``None`` when this checker checks."""
        return self._following

    def check(self) -> tuple[BackendStatus, ...]:
        """Each backend's status, in configuration order; at most ``cache_ms`` old.

        The circuit states are read now, not cached. A checker that follows
        another's rounds (:meth:`follow`) checks nothing and answers what it was given.
        """
        if self._following is not None:
            return self._following
        with self._lock:  # one refresh at a time; the others then read its result
            if self._cached is None or self._clock.monotonic() - self._checked_at >= self._cache_s:
                fresh = self._refresh()
                following = self.following()  # told to follow while it checked?
                if following is not None:
                    return following
                self._cached, self._checked_at = fresh, self._clock.monotonic()
            return self.current()

    def current(self) -> tuple[BackendStatus, ...]:
        """The last round of checks without starting one (empty before the first), with
        the circuit states as they are now: what the probes, the gauge and ``health()`` say."""
        if self._following is not None:
            return self._following
        cached = self._cached or ()
        states = tuple(breaker.state.value for breaker in self._breakers)
        if self._answer is None or self._answer[0] is not cached or self._answer[1] != states:
            # Callers in one round share one answer while the circuits stay as they were.
            self._answer = (
                cached,
                states,
                tuple(
                    dataclasses.replace(status, circuit=state)
                    for status, state in zip(cached, states)
                ),
            )
        return self._answer[2]

    def circuits(self) -> dict[str, str]:
        """Each backend's circuit breaker as this process's lookups see it now, by name."""
        return {
            name: breaker.state.value for (name, _), breaker in zip(self._probes, self._breakers)
        }

    def watch(self, interval_s: float) -> HealthChecker:
        """Check every ``interval_s`` from now on, whether or not anyone asks, so that a
        backend going down shows in the probes and the gauge with no traffic at all."""
        if self._watcher is None:
            self._watcher = spawn_in_context(self._watch, interval_s)
        return self

    def _watch(self, interval_s: float) -> None:
        while self._following is None:
            self.check()
            self._clock.sleep(interval_s)

    def stop_watching(self) -> None:
        """End :meth:`watch` (at once when it sleeps, after its round when it checks)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            # It sleeps or waits for its checks, each a greenlet of its own that ends on its
            # own timeout: no library call is interrupted.
            watcher.kill(block=False)

    def follow(self, statuses: Iterable[BackendStatus]) -> None:
        """From now on answer ``statuses`` (circuits included) instead of checking: a worker
        of a pre-forked group reports the master's rounds, one truth for the group. A
        backend the master found up is a successful probe of this process's circuit too."""
        self._following = tuple(statuses)
        self._probe_circuits(self._following)

    def _refresh(self) -> tuple[BackendStatus, ...]:
        # A check still running from an earlier round is not started again: a backend that
        # hangs past its timeout holds one greenlet, never one more per round.
        checks = [
            self._running[name]
            if name in self._running and not self._running[name].dead
            else spawn_in_context(self._timed, name, probe)
            for name, probe in self._probes
        ]
        self._running = {name: check for (name, _), check in zip(self._probes, checks)}
        until = self._clock.monotonic() + self._timeout_s + _JOIN_MARGIN_S
        for check in checks:
            self._clock.join(check, until)
        late_ms = round((self._timeout_s + _JOIN_MARGIN_S) * 1000.0, 3)
        # A check still running is left to end on its own timeout, not killed.
        statuses = tuple(
            check.value
            if check.successful()
            else BackendStatus(name, False, late_ms, _no_answer(self._timeout_s))
            for (name, _), check in zip(self._probes, checks)
        )
        self._probe_circuits(statuses)
        return statuses

    def _probe_circuits(self, statuses: Iterable[BackendStatus]) -> None:
        """A passing check is a successful probe of that backend's circuit."""
        up = {status.name for status in statuses if status.up}
        for (name, _), breaker in zip(self._probes, self._breakers):
            if name in up:
                breaker.checked_healthy()

    def _timed(self, name: str, probe: Callable[[], None]) -> BackendStatus:
        started = self._clock.monotonic()
        detail = ""
        # Imported here: the instrumentation package (and its dependency checks) costs a
        # process's start tens of milliseconds, and a server without checks never needs it.
        from opentelemetry.instrumentation.utils import suppress_instrumentation

        with suppress_instrumentation():
            try:
                probe()
            except Exception as exc:  # noqa: BLE001 - any failure of a probe means "not healthy"
                detail = _describe(exc, self._timeout_s)
        latency_ms = round((self._clock.monotonic() - started) * 1000.0, 3)
        return BackendStatus(name, not detail, latency_ms, detail)


def _no_answer(timeout_s: float) -> str:
    return f"no answer within {timeout_s * 1000:.0f} ms"


def _describe(exc: Exception, timeout_s: float) -> str:
    """Why a check failed, from the exception's kind only (messages may quote credentials)."""
    kind = type(exc).__name__
    if isinstance(exc, HttpStatusError):
        return str(exc)
    if isinstance(exc, (requests.Timeout, TimeoutError)) or (
        isinstance(exc, PyMongoError) and exc.timeout
    ):
        return f"{_no_answer(timeout_s)} ({kind})"
    if isinstance(exc, BackendUnavailable):  # MongoDB: pymongo recorded why it cannot connect
        return "cannot connect (no server accepts connections)"
    if isinstance(exc, (OSError, ConnectionFailure)):  # requests' errors are OSErrors too
        return f"cannot connect ({kind})"
    if isinstance(exc, OperationFailure):
        return f"ping refused (code {exc.code})"
    return f"check failed ({kind})"
