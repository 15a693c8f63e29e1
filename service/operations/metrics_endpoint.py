"""``GET /metrics`` for Prometheus, answered off the event loop and always in time.

The endpoint is served from a native thread (:mod:`service.operations.native_http`); the
collection itself (the SDK's readers and every observable callback, which read
state the event loop owns without locks) runs on the event loop, handed over
with :func:`~service.operations.native_http.call_on_main_loop`. When the loop does not
finish it within :data:`COLLECT_TIMEOUT_S` (saturated, or blocked), the scrape
gets the last collection's text, with a comment line saying how old it is, so
a scrape never times out: Prometheus keeps the series and their counters
continuous instead of marking the target down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import gevent
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lookups.clock import SYSTEM_CLOCK, Clock
from service.operations.native_http import NativeHttpServer, call_on_main_loop

__all__ = ["MetricsEndpoint", "COLLECT_TIMEOUT_S"]

log = logging.getLogger(__name__)

#: How long a scrape waits for the event loop to collect before it gets the last collection.
COLLECT_TIMEOUT_S = 0.5


class MetricsEndpoint:
    """Serve ``registry`` at ``http://host:port/metrics``; :meth:`start` and :meth:`stop`.

    Start it from the thread running the event loop that owns the instruments. ``clock``
    (the service's) dates each collection, for the age a late scrape is told.
    """

    def __init__(self, registry: Any, host: str, port: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self._registry = registry
        self._clock = clock
        self._server = NativeHttpServer(host, port, self._app, "metrics")
        self._loop: Any = None
        self._last: tuple[float, bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def start(self) -> MetricsEndpoint:
        self._loop = gevent.get_hub().loop
        self._server.start()
        log.info("metrics: Prometheus scrape at http://%s:%d/metrics", *self.address)
        return self

    def stop(self) -> None:
        self._server.stop(timeout_s=1.0)

    def collect(self) -> bytes:
        """The registry in Prometheus' text format (on the event loop's thread)."""
        body = generate_latest(self._registry)
        self._last = (self._clock.monotonic(), body)
        return body

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the scrape path is /metrics\n"]
        done, body = call_on_main_loop(self._loop, self.collect, COLLECT_TIMEOUT_S)
        if not done:
            last = self._last
            if last is None:
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"the first collection has not finished yet\n"]
            age_s = self._clock.monotonic() - last[0]
            body = (
                last[1]
                + (
                    f"# the event loop did not collect within {COLLECT_TIMEOUT_S} s: "
                    f"values as collected {age_s:.1f} s ago\n"
                ).encode()
            )
        start_response(
            "200 OK",
            [
                ("Content-Type", CONTENT_TYPE_LATEST),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [body]
