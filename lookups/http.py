"""HTTP lookups: the alerts, latency and volume panels.

Contracts (``app`` is one URL path segment, percent-quoted with no safe characters)::

    GET {alerts_url}/apps/{app}/alerts?start_ms=&end_ms=
        -> {"alerts": [{"id", "severity", "title", "triggered_ms"}, ...]}
    GET {metrics_url}/apps/{app}/series/{latency|volume}?start_ms=&end_ms=&step_ms=
        -> {"points": [[ts_ms, value], ...]}

Every call is bounded three ways: requests' ``timeout=(connect, read)`` (each at most
the task budget and the ``http.*_timeout_ms`` settings), a gevent timer on the whole
exchange (a server that drips bytes cannot stretch it past the budget), and at most
MAX_RESPONSE_BYTES of body. Redirects are not followed: lookups only ever call the
configured base URLs.
"""

from __future__ import annotations

import abc
import functools
import json
import math
import operator
import time
from typing import Any, ClassVar, NoReturn, Optional
from urllib.parse import quote, urlencode

import gevent
import requests
from requests.hooks import default_hooks
from requests.structures import CaseInsensitiveDict

from lookups.base import Lookup
from lookups.clients import BackendGuards, HttpSlots
from lookups.errors import (BackendTimeout, BackendUnavailable, BadBackendResponse, LookupFailed,
                            blame_own_wait)
from lookups.panels import Alert, AlertList, Point, Series, Window
from lookups.settings import HttpSettings, MongoSettings
from tracing.clients import remote_call
from tracing.propagation import inject_headers

__all__ = ["MAX_RESPONSE_BYTES", "MAX_ITEMS", "MAX_POINTS", "MIN_STEP_MS", "step_ms_for",
           "connect_timeout_s",
           "app_path_segment", "HttpLookup", "AlertsLookup", "SeriesLookup", "LatencyLookup",
           "VolumeLookup"]

MAX_RESPONSE_BYTES = 4 * 1024 * 1024
MAX_ITEMS = 10_000          # alerts or points in one answer
MAX_POINTS = 120            # a series asks for at most this many buckets...
MIN_STEP_MS = 60_000        # ...each a whole number of minutes, at least one
_CHUNK_BYTES = 64 * 1024
_BY_TS = operator.attrgetter("ts_ms")
# Answers that say "not now" from a gateway or an overloaded server: safe to try again.
_RETRY_SAFE_STATUS = frozenset({502, 503, 504})
_NO_COOKIES = requests.cookies.RequestsCookieJar()


def step_ms_for(window: Window) -> int:
    """The series step for ``window``: whole minutes, at least one, at most MAX_POINTS buckets.

    A day is 1440 minutes, so it gets 12-minute steps (120 points); an hour gets 1-minute
    steps (60 points).
    """
    span_ms = max(window.end_ms - window.start_ms, 1)
    minutes = math.ceil(span_ms / (MAX_POINTS * MIN_STEP_MS))
    return max(minutes, 1) * MIN_STEP_MS


def connect_timeout_s(settings: HttpSettings, budget_s: float) -> float:
    """The connect timeout of one attempt with ``budget_s`` left.

    At least ``http.connect_timeout_ms``, and up to half the budget: a listen queue
    that is full drops the SYN, and Linux sends it again after 1 s, then 3 s. With
    budget to spare, one attempt then lives through those retransmissions; with
    little, it gives up early enough for a retry's fresh SYN. Never past the budget.
    """
    return min(budget_s, max(settings.connect_timeout_ms / 1000.0, budget_s / 2.0))


def app_path_segment(app: str) -> str:
    """``app`` as one path segment that cannot leave ``/apps/``.

    ``quote(safe="")`` encodes ``/``, ``?``, ``#`` and ``%``. The names ``""``, ``.`` and
    ``..`` cannot be sent as a segment at all: requests decodes ``%2E`` back to ``.``, and
    servers and proxies collapse dot segments. They raise
    :class:`~lookups.errors.LookupFailed` (not retryable).
    """
    if app in ("", ".", ".."):
        raise LookupFailed(f"app name {app!r} cannot be used in a URL path")
    return quote(app, safe="")


class HttpLookup(Lookup, abc.ABC):
    """A lookup that GETs JSON from one configured service.

    :meth:`fetch` raises :class:`~lookups.errors.BackendUnavailable` when the service
    refuses or resets the connection or answers 5xx, :class:`~lookups.errors.BackendTimeout`
    when the budget runs out, and :class:`~lookups.errors.BadBackendResponse` on 3xx/4xx,
    a body over MAX_RESPONSE_BYTES, invalid JSON or JSON of the wrong shape.
    """

    source: ClassVar[str] = "http"
    #: The called service's logical name: ``peer.service`` on the request's span.
    service: ClassVar[str]
    #: The path with ``{app}`` for the app: ``url.template``, and the span's name.
    route: ClassVar[str]

    def __init__(self, session: requests.Session, settings: HttpSettings,
                 slots: Optional[HttpSlots] = None, guards: Optional[BackendGuards] = None) -> None:
        """``slots`` bounds calls in flight per service, ``guards`` retries and breaks circuits
        per service; share the clients' (``BackendClients.http_slots``, ``.guards``)."""
        self._session = session
        self._settings = settings
        self._slots = slots or HttpSlots(settings.pool_maxsize)
        self._guards = guards or BackendGuards(MongoSettings(), settings, {})

    def _get_json(self, base_url: str, path: str, params: dict[str, int], timeout_s: float) -> Any:
        """GET ``path`` of ``base_url`` as JSON, through the service's guard (retries, breaker)."""
        guard = self._guards.for_url(base_url)
        return guard.call(self.name, lambda left_s: self._attempt(base_url, path, params, left_s),
                          timeout_s)

    def _attempt(self, base_url: str, path: str, params: dict[str, int], timeout_s: float) -> Any:
        if timeout_s <= 0:
            raise BackendTimeout(f"{self.name}: no time left to call the service",
                                 backend_fault=False)
        timeouts = (connect_timeout_s(self._settings, timeout_s),
                    min(self._settings.read_timeout_ms / 1000, timeout_s))
        slot = self._slots.for_url(base_url)
        acquired, began = False, time.monotonic()
        timer = gevent.Timeout(timeout_s)
        timer.start()
        try:
            acquired = slot.acquire(timeout=timeout_s)
            if not acquired:
                raise BackendTimeout(f"{self.name}: no free connection to the service "
                                     f"within {timeout_s:.3f}s", backend_fault=False)
            waited_s = time.monotonic() - began
            try:
                body = self._get_body(_prepared_base(base_url) + path, params, timeouts)
            except BackendTimeout as slow:
                raise blame_own_wait(slow, waited_s, timeout_s)
        except gevent.Timeout as fired:
            if fired is not timer:
                raise
            raise blame_own_wait(BackendTimeout(f"{self.name}: no complete answer within "
                                                f"{timeout_s:.3f}s"),
                                 time.monotonic() - began if not acquired else waited_s,
                                 timeout_s) from None
        except requests.RequestException as exc:
            _raise_transport_error(self.name, exc, before_response=False)
        finally:
            timer.close()
            if acquired:
                slot.release()
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except ValueError as exc:
            raise BadBackendResponse(f"{self.name}: response is not valid JSON") from exc

    def _get_body(self, url: str, params: dict[str, int], timeouts: tuple[float, float]) -> bytes:
        try:
            with remote_call(self.service, self.route):
                response = self._session.send(self._prepare(url, params), timeout=timeouts,
                                              stream=True, allow_redirects=False)
        except requests.RequestException as exc:
            _raise_transport_error(self.name, exc, before_response=True)
        try:
            if response.status_code >= 500:
                raise BackendUnavailable(f"{self.name}: service answered HTTP {response.status_code}",
                                         retry_safe=response.status_code in _RETRY_SAFE_STATUS)
            if response.status_code >= 300:
                raise BadBackendResponse(f"{self.name}: service answered HTTP {response.status_code}")
            return self._read_bounded(response)
        finally:
            # Returns the connection to the pool, or drops it when the body was not read.
            response.close()

    def _prepare(self, url: str, params: dict[str, int]) -> requests.PreparedRequest:
        """The GET, built from parts that need no checking, for ``Session.send``.

        ``Session.get`` merges the session's settings, cookies, hooks and environment
        into a new request on every call, and ``PreparedRequest.prepare`` then parses
        and re-quotes the URL, encodes the parameters and checks every header: together
        about a fifth of an HTTP lookup's CPU (the merge measured with py-spy, the rest in
        alternating runs, about 130 us of 1.2 ms). Here the base URL is prepared by
        requests once (:func:`_prepared_base`), the path is one quoted segment under it,
        the parameters are integers, and the headers are the session's and ours. No
        cookies are sent: lookups are stateless, and a backend's ``Set-Cookie`` is not
        kept for the next call. ``Session.send`` (what the requests instrumentation
        traces) still runs.
        """
        prepared = requests.PreparedRequest()
        prepared.method = "GET"
        prepared.url = f"{url}?{urlencode(params)}"
        # The trace context, also when unsampled: the requests instrumentation is off then,
        # and overwrites it when on.
        prepared.headers = CaseInsensitiveDict({**self._session.headers, "Accept": "application/json",
                                                **inject_headers()})
        prepared.hooks = default_hooks()
        # Read by requests only for a redirect's next request (which is never sent);
        # it copies the jar before writing to it, so this empty one stays empty.
        prepared._cookies = _NO_COOKIES
        return prepared

    def _read_bounded(self, response: requests.Response) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
            raise BadBackendResponse(f"{self.name}: response larger than {MAX_RESPONSE_BYTES} bytes")
        chunks, size = [], 0
        for chunk in response.iter_content(_CHUNK_BYTES):
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise BadBackendResponse(f"{self.name}: response larger than {MAX_RESPONSE_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


class AlertsLookup(HttpLookup):
    """Alerts triggered in the window, sorted by ``triggered_ms`` then ``id``."""

    name: ClassVar[str] = "alerts"
    service: ClassVar[str] = "alerts"
    route: ClassVar[str] = "/apps/{app}/alerts"

    def fetch(self, window: Window, timeout_s: float) -> AlertList:
        path = self.route.format(app=app_path_segment(window.app))
        params = {"start_ms": window.start_ms, "end_ms": window.end_ms}
        body = self._get_json(self._settings.alerts_url, path, params, timeout_s)
        items = _list_field(self.name, body, "alerts")
        alerts = [Alert(id=_typed(self.name, item, "id", str),
                        severity=_typed(self.name, item, "severity", str),
                        title=_typed(self.name, item, "title", str),
                        triggered_ms=_typed(self.name, item, "triggered_ms", int))
                  for item in items]
        return AlertList(tuple(sorted(alerts, key=lambda a: (a.triggered_ms, a.id))))


class SeriesLookup(HttpLookup):
    """One metric series over the window, at the step :func:`step_ms_for` chooses."""

    service: ClassVar[str] = "metrics"

    def fetch(self, window: Window, timeout_s: float) -> Series:
        step_ms = step_ms_for(window)
        path = self.route.format(app=app_path_segment(window.app))
        params = {"start_ms": window.start_ms, "end_ms": window.end_ms, "step_ms": step_ms}
        body = self._get_json(self._settings.metrics_url, path, params, timeout_s)
        points = self._points(_list_field(self.name, body, "points"))
        return Series(points=tuple(sorted(points, key=_BY_TS)), step_ms=step_ms)

    def _points(self, items: list[Any]) -> list[Point]:
        """``[ts_ms, value]`` pairs as points. Exact type checks: ``json`` makes exactly
        ``list``, ``int`` and ``float`` (a bool is not an int here), and this loop runs for
        every point of every series, so it avoids the generic checks' calls."""
        points = []
        for item in items:
            if type(item) is not list or len(item) != 2:
                raise BadBackendResponse(f"{self.name}: a point is not a [ts_ms, value] pair")
            ts_ms, value = item
            kind = type(value)
            if type(ts_ms) is not int or (kind is not float and kind is not int):
                raise BadBackendResponse(f"{self.name}: a point is not [integer, number]")
            points.append(Point(ts_ms, float(value)))
        return points


class LatencyLookup(SeriesLookup):
    name: ClassVar[str] = "latency"
    route: ClassVar[str] = "/apps/{app}/series/latency"


class VolumeLookup(SeriesLookup):
    name: ClassVar[str] = "volume"
    route: ClassVar[str] = "/apps/{app}/series/volume"


def _raise_transport_error(lookup: str, exc: requests.RequestException, *,
                           before_response: bool) -> NoReturn:
    """Typed; ``retry_safe`` when nothing of an answer came yet and the cause was the
    connection (refused, connect timeout, reset), not a slow server."""
    kind = type(exc).__name__
    if isinstance(exc, requests.ConnectTimeout):
        raise BackendTimeout(f"{lookup}: no connection to the service ({kind})",
                             retry_safe=True) from exc
    if isinstance(exc, requests.Timeout):
        raise BackendTimeout(f"{lookup}: service too slow ({kind})") from exc
    if isinstance(exc, requests.exceptions.SSLError):
        # An untrusted certificate stays untrusted: no retry within the task.
        raise BackendUnavailable(f"{lookup}: TLS with the service failed; does http.ca_file "
                                 f"hold its CA? ({kind})") from exc
    if isinstance(exc, (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)):
        safe = before_response and isinstance(exc, requests.ConnectionError)
        raise BackendUnavailable(f"{lookup}: cannot reach the service ({kind})",
                                 retry_safe=safe) from exc
    if isinstance(exc, requests.exceptions.ContentDecodingError):
        raise BadBackendResponse(f"{lookup}: undecodable response body ({kind})") from exc
    raise LookupFailed(f"{lookup}: HTTP request failed ({kind})") from exc


@functools.lru_cache(maxsize=64)
def _prepared_base(base_url: str) -> str:
    """``base_url`` as requests prepares a URL (IDNA host, quoting), without a final ``/``."""
    prepared = requests.PreparedRequest()
    prepared.prepare_url(base_url.rstrip("/"), None)
    return prepared.url.rstrip("/")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _is_number(value: Any, kind: type | tuple[type, ...]) -> bool:
    # bool is an int in Python, never a timestamp or a measurement in JSON.
    return isinstance(value, kind) and not isinstance(value, bool)


def _list_field(lookup: str, body: Any, key: str) -> list[Any]:
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise BadBackendResponse(f"{lookup}: expected an object with a {key!r} list")
    if len(items) > MAX_ITEMS:
        raise BadBackendResponse(f"{lookup}: more than {MAX_ITEMS} {key}")
    return items


def _typed(lookup: str, item: Any, key: str, kind: type) -> Any:
    value = item.get(key) if isinstance(item, dict) else None
    valid = _is_number(value, int) if kind is int else isinstance(value, kind)
    if not valid:
        raise BadBackendResponse(f"{lookup}: field {key!r} is not {kind.__name__}")
    return value
