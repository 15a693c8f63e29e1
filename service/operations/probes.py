"""HTTP probes for orchestrators, on ``server.probe_port`` (off by default; 0 picks a
free port, logged).

A probe speaking Thrift would exec ``fanout call health``, a process start per
probe; these answer plain HTTP with a JSON body saying why:

* ``GET /healthz`` (liveness): 200 while the server's event loop runs: it has
  beaten within ``server.worker_heartbeat_timeout_ms`` (a busy loop beats late,
  a stuck one not at all); 503 otherwise, and 0 turns the check off.
* ``GET /readyz`` (readiness): 200 while the server is serving; 503 while it is
  draining (the lame duck included), so load balancers move away first.

Both are served from a native thread (:mod:`service.operations.native_http`), so they
answer while the event loop that runs calls is saturated; the loop only writes
what they read (its beat, the draining flag, the last backend checks, which the
service refreshes every few seconds whatever its traffic: :mod:`service.operations.health`).
Both bodies carry those checks, with the circuits as they are now, as ``health()`` does,
and beside them the results cache's shared store (``cache``) when it is Redis, as the
cache's last command found it.

Readiness means what Kubernetes gives it: send this pod traffic. A backend
down is not a reason to stop: every replica shares the backends, so making
them all NotReady on one backend's blip would empty the Service (the headless
Service's DNS with it) while Fanout still answers every other panel, and the
panels of the down backend with typed errors at once. Envoy's active health
checks and outlier detection judge an endpoint the same way, by whether it
answers. So backends are reported (``/readyz``'s and ``/healthz``'s bodies,
``health()``, the ``fanout.backend.up`` gauge), never used to refuse traffic.

Anything else is 404. Nothing is traced or logged per probe.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import gevent

from lookups.clock import SYSTEM_CLOCK, Clock
from service.operations.health import BackendStatus, HealthChecker
from service.operations.native_http import NativeHttpServer
from tracing.context import spawn_in_context

__all__ = ["ProbeServer", "REFRESH_S", "json_answer", "backend_bodies"]

log = logging.getLogger(__name__)

#: How often the loop beats for /healthz.
REFRESH_S = 2.0


class ProbeServer:
    """The probe endpoint of one server; :meth:`start` and :meth:`stop`.

    ``stale_after_s``: how long the loop may go without beating before /healthz
    says 503 (0: never). ``stores``: the results cache's shared store, shown beside the
    backends (:func:`~service.operations.health.store_statuses`). ``clock``, the
    service's, times the beats and the silence.
    """

    def __init__(
        self,
        host: str,
        port: int,
        health: HealthChecker,
        draining: Callable[[], bool],
        stale_after_s: float = 30.0,
        stores: Callable[[], Iterable[BackendStatus]] = tuple,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        self._health = health
        self._stores = stores
        self._draining = draining
        self._stale_after_s = stale_after_s
        self._beat = clock.monotonic()
        self._refresher: gevent.Greenlet | None = None
        self._server = NativeHttpServer(host, port, self._app, "probes")

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def start(self) -> ProbeServer:
        self._server.start()
        self._refresher = spawn_in_context(self._refresh)
        log.info("probes: http://%s:%d/healthz and /readyz", *self.address)
        return self

    def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.kill(block=False)  # it only sleeps or checks on its own session
        self._server.stop(timeout_s=1.0)

    def _refresh(self) -> None:
        while True:
            self._beat = self._clock.monotonic()
            self._clock.sleep(REFRESH_S)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        backends = backend_bodies([*self._health.current(), *self._stores()])
        if path == "/healthz":
            silent_s = self._clock.monotonic() - self._beat
            if self._stale_after_s and silent_s > self._stale_after_s + REFRESH_S:
                return json_answer(
                    start_response,
                    503,
                    {"status": f"event loop silent for {silent_s:.0f} s", "backends": backends},
                )
            return json_answer(start_response, 200, {"status": "ok", "backends": backends})
        if path == "/readyz":
            draining = self._draining()
            body = {"status": "draining" if draining else "ready", "backends": backends}
            return json_answer(start_response, 503 if draining else 200, body)
        return json_answer(start_response, 404, {"status": "not found"})


def backend_bodies(statuses: Iterable[BackendStatus]) -> dict[str, Any]:
    """The backends as the probe bodies give them."""
    return {s.name: {"up": s.up, "circuit": s.circuit, "detail": s.detail} for s in statuses}


_REASONS = {200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}


def json_answer(
    start_response: Callable[..., Any], status: int, body: dict[str, Any]
) -> list[bytes]:
    """Answer a WSGI request with ``body`` as JSON, never cached."""
    payload = json.dumps(body).encode()
    start_response(
        _REASONS[status],
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            ("Cache-Control", "no-store"),
        ],
    )
    return [payload]
