"""HTTP probes for orchestrators, on ``server.probe_port`` (off by default; 0 picks a
free port, logged).

A probe speaking Thrift would exec ``fanout call health``, a process start per
probe; these answer plain HTTP with a JSON body saying why:

* ``GET /healthz`` (liveness): 200 while the server's event loop answers at all.
  The body carries the last round of backend checks, without starting one.
* ``GET /readyz`` (readiness): 200 while the server is serving; 503 while it is
  draining (the lame duck included), so load balancers move away first.

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
from typing import Any, Callable, Iterable

from gevent.pywsgi import WSGIServer

from service.health import BackendStatus, HealthChecker

__all__ = ["ProbeServer"]

log = logging.getLogger(__name__)


class ProbeServer:
    """The probe endpoint of one server; :meth:`start` and :meth:`stop`."""

    def __init__(self, host: str, port: int, health: HealthChecker,
                 draining: Callable[[], bool]) -> None:
        self._health = health
        self._draining = draining
        self._server = WSGIServer((host, port), self._app, log=None, error_log=None)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.address[:2]
        return host, port

    def start(self) -> "ProbeServer":
        self._server.start()
        log.info("probes: http://%s:%d/healthz and /readyz", *self.address)
        return self

    def stop(self) -> None:
        self._server.stop(timeout=1.0)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _answer(start_response, 200,
                           {"status": "ok", "backends": _backends(self._health.last())})
        if path == "/readyz":
            draining = self._draining()
            body = {"status": "draining" if draining else "ready",
                    "backends": _backends(self._health.check())}
            return _answer(start_response, 503 if draining else 200, body)
        return _answer(start_response, 404, {"status": "not found"})


def _backends(statuses: Iterable[BackendStatus]) -> dict[str, Any]:
    return {s.name: {"up": s.up, "circuit": s.circuit, "detail": s.detail} for s in statuses}


_REASONS = {200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}


def _answer(start_response: Callable[..., Any], status: int, body: dict[str, Any]) -> list[bytes]:
    payload = json.dumps(body).encode()
    start_response(_REASONS[status], [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(payload))),
                                      ("Cache-Control", "no-store")])
    return [payload]
