"""The sample alerts and metrics HTTP services: small WSGI apps on gevent's WSGI server.

    GET /apps/{app}/alerts?start_ms=&end_ms=
        -> 200 {"alerts": [{"id", "severity", "title", "triggered_ms"}, ...]}
    GET /apps/{app}/series/{latency|volume}?start_ms=&end_ms=&step_ms=
        -> 200 {"points": [[bucket_start_ms, value], ...]}

A series has one point per step bucket ``[start_ms + k*step_ms, ...)`` in the window
that holds samples: the mean of the latency samples, the sum of the volume samples.
Unknown apps or paths answer 404, bad parameters 400, both with ``{"error": ...}``.
Each service can wait ``delay_ms`` before answering, to make parallelism visible.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import ssl
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import gevent
from gevent.pywsgi import WSGIHandler, WSGIServer

from service.samples.seed import AlertRecord, MetricSample, SampleData

__all__ = [
    "SampleHttpServices",
    "AlertsService",
    "MetricsService",
    "InFlight",
    "RawPathHandler",
    "serve_wsgi",
    "path_segments",
    "MAX_BUCKETS",
]

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
MAX_BUCKETS = 100_000


class RawPathHandler(WSGIHandler):
    """Adds ``RAW_URI`` (the request target as sent) to the WSGI environ.

    ``PATH_INFO`` is already percent-decoded, so an app name holding ``/`` could not be
    told apart from a path separator there.
    """

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        environ["RAW_URI"] = self.path
        result: dict[str, Any] = environ
        return result


def serve_wsgi(
    app: WsgiApp, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
) -> WSGIServer:
    """Start ``app`` on ``port`` of ``host`` (0: a free one), over HTTPS with ``ssl_context``;
    it accepts once this returns."""
    tls: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    server = WSGIServer((host, port), app, log=None, handler_class=RawPathHandler, **tls)
    server.start()
    return server


def path_segments(environ: dict[str, Any]) -> list[str]:
    """The request path's segments, each percent-decoded on its own."""
    raw = environ.get("RAW_URI") or quote(environ.get("PATH_INFO", ""))
    path = raw.split("?", 1)[0]
    return [unquote(segment) for segment in path.split("/")[1:]]


class _HttpError(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def _respond(start_response: Callable[..., Any], status: str, body: Any) -> list[bytes]:
    payload = json.dumps(body).encode()
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
    )
    return [payload]


def _int_param(environ: dict[str, Any], name: str) -> int:
    values = parse_qs(environ.get("QUERY_STRING", "")).get(name, [])
    try:
        return int(values[0])
    except (IndexError, ValueError):
        raise _HttpError("400 Bad Request", f"{name} must be an integer") from None


def _window(environ: dict[str, Any]) -> tuple[int, int]:
    start_ms, end_ms = _int_param(environ, "start_ms"), _int_param(environ, "end_ms")
    if end_ms < start_ms:
        raise _HttpError("400 Bad Request", "end_ms must not be before start_ms")
    return start_ms, end_ms


class InFlight:
    """The panel requests being answered at once by the services sharing this, and the most
    seen: what shows that a caller sent them in parallel, whatever the time they took."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    def __enter__(self) -> InFlight:
        self.now += 1
        self.most = max(self.most, self.now)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.now -= 1


class _SampleService:
    """Shared request handling: method check, delay, error bodies."""

    def __init__(self, data: SampleData, delay_ms: int = 0) -> None:
        self.data = data
        self.delay_ms = delay_ms
        self.in_flight = InFlight()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        segments = path_segments(environ)
        # The base URL answers, as a health check expects (lookups/backends/http.py); only
        # the panels' requests count as in flight.
        base = segments in ([], [""])
        with contextlib.nullcontext() if base else self.in_flight:
            if self.delay_ms > 0:
                gevent.sleep(self.delay_ms / 1000)
            try:
                if environ.get("REQUEST_METHOD") != "GET":
                    raise _HttpError("405 Method Not Allowed", "only GET is served")
                body = {"status": "ok"} if base else self.answer(segments, environ)
            except _HttpError as exc:
                return _respond(start_response, exc.status, {"error": str(exc)})
            return _respond(start_response, "200 OK", body)

    def answer(self, segments: list[str], environ: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _known_app(self, app: str) -> str:
        if app not in self.data.apps:
            raise _HttpError("404 Not Found", f"unknown app {app!r}")
        return app


class AlertsService(_SampleService):
    """``/apps/{app}/alerts``: the app's alerts triggered in ``[start_ms, end_ms)``."""

    def answer(self, segments: list[str], environ: dict[str, Any]) -> Any:
        if len(segments) != 3 or segments[0] != "apps" or segments[2] != "alerts":
            raise _HttpError("404 Not Found", "no such path")
        app = self._known_app(segments[1])
        start_ms, end_ms = _window(environ)
        return {
            "alerts": [
                _alert_json(alert)
                for alert in self.data.alerts
                if alert.app == app and start_ms <= alert.triggered_ms < end_ms
            ]
        }


def _alert_json(alert: AlertRecord) -> dict[str, Any]:
    return {
        "id": alert.id,
        "severity": alert.severity,
        "title": alert.title,
        "triggered_ms": alert.triggered_ms,
    }


class MetricsService(_SampleService):
    """``/apps/{app}/series/{latency|volume}``: bucketed per-minute samples."""

    def __init__(self, data: SampleData, delay_ms: int = 0) -> None:
        super().__init__(data, delay_ms)
        by_app: dict[str, list[MetricSample]] = defaultdict(list)
        for sample in data.metrics:
            by_app[sample.app].append(sample)
        self._samples = {
            app: sorted(samples, key=lambda s: s.ts_ms) for app, samples in by_app.items()
        }

    def answer(self, segments: list[str], environ: dict[str, Any]) -> Any:
        if (
            len(segments) != 4
            or segments[0] != "apps"
            or segments[2] != "series"
            or segments[3] not in ("latency", "volume")
        ):
            raise _HttpError("404 Not Found", "no such path")
        app = self._known_app(segments[1])
        start_ms, end_ms = _window(environ)
        step_ms = _int_param(environ, "step_ms")
        if step_ms < 1 or (end_ms - start_ms) // step_ms > MAX_BUCKETS:
            raise _HttpError(
                "400 Bad Request", f"step_ms must be >= 1 and give at most {MAX_BUCKETS} buckets"
            )
        return {"points": self._points(app, segments[3], start_ms, end_ms, step_ms)}

    def _points(
        self, app: str, metric: str, start_ms: int, end_ms: int, step_ms: int
    ) -> list[list[float]]:
        samples = self._samples.get(app, [])
        times = [sample.ts_ms for sample in samples]
        buckets: dict[int, list[float]] = defaultdict(list)
        for sample in samples[
            bisect.bisect_left(times, start_ms) : bisect.bisect_left(times, end_ms)
        ]:
            value = sample.latency_ms if metric == "latency" else sample.volume
            buckets[(sample.ts_ms - start_ms) // step_ms].append(value)
        reduce: Callable[[list[float]], float] = (
            (lambda values: sum(values) / len(values)) if metric == "latency" else sum
        )
        return [
            [start_ms + index * step_ms, reduce(values)]
            for index, values in sorted(buckets.items())
        ]


class SampleHttpServices:
    """The alerts and metrics services, each on its own free port of ``host``.

    ``alerts`` and ``metrics`` are the WSGI apps; their ``delay_ms`` may be changed
    while running. ``in_flight`` counts the panel requests the two answer at once.
    With ``ssl_context`` (a server context) both speak HTTPS.
    """

    def __init__(
        self,
        data: SampleData,
        *,
        host: str = "127.0.0.1",
        alerts_delay_ms: int = 0,
        metrics_delay_ms: int = 0,
        alerts_port: int = 0,
        metrics_port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self._ssl_context = ssl_context
        self._ports = (alerts_port, metrics_port)  # 0: a free port
        self.alerts = AlertsService(data, alerts_delay_ms)
        self.metrics = MetricsService(data, metrics_delay_ms)
        self.in_flight = self.alerts.in_flight = self.metrics.in_flight = InFlight()  # both
        self._servers: tuple[WSGIServer, WSGIServer] | None = None

    def start(self) -> SampleHttpServices:
        """Start both servers; idempotent. They accept connections once this returns."""
        if self._servers is None:
            alerts = serve_wsgi(self.alerts, self.host, self._ports[0], self._ssl_context)
            try:
                self._servers = (
                    alerts,
                    serve_wsgi(self.metrics, self.host, self._ports[1], self._ssl_context),
                )
            except Exception:
                alerts.stop(timeout=1)
                raise
        return self

    @property
    def alerts_url(self) -> str:
        return self._url(0)

    @property
    def metrics_url(self) -> str:
        return self._url(1)

    def _url(self, which: int) -> str:
        if self._servers is None:
            raise RuntimeError("the sample HTTP services are not started")
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self._servers[which].server_port}"

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop both servers, ending requests still running after ``timeout_s``; idempotent."""
        servers, self._servers = self._servers, None
        for server in servers or ():
            server.stop(timeout=timeout_s)

    def __enter__(self) -> SampleHttpServices:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
