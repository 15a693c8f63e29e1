"""HTTP lookups: the alerts, latency and volume panels.

Contracts (``app`` is one URL path segment, percent-quoted with no safe characters)::

    GET {alerts url}/apps/{app}/alerts?start_ms=&end_ms=
        -> {"alerts": [{"id", "severity", "title", "triggered_ms"}, ...]}
    GET {metrics url}/apps/{app}/series/{latency|volume}?start_ms=&end_ms=&step_ms=
        -> {"points": [[ts_ms, value], ...]}

The call itself (slots, retries, timeouts, the size bound, typed errors) is the
backend's: :mod:`lookups.backends.http`. A lookup builds the path, and checks and
converts the answer.
"""

from __future__ import annotations

import abc
import math
import operator
from typing import Any, ClassVar
from urllib.parse import quote

from lookups.backends.http import HttpBackend
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.errors import BadBackendResponse, LookupFailed
from lookups.panels import Alert, AlertList, Point, Series, Window

__all__ = [
    "MAX_ITEMS",
    "MAX_POINTS",
    "MIN_STEP_MS",
    "step_ms_for",
    "app_path_segment",
    "HttpLookup",
    "AlertsLookup",
    "SeriesLookup",
    "LatencyLookup",
    "VolumeLookup",
]

MAX_ITEMS = 10_000  # alerts or points in one answer
MAX_POINTS = 120  # a series asks for at most this many buckets...
MIN_STEP_MS = 60_000  # ...each a whole number of minutes, at least one
_BY_TS = operator.attrgetter("ts_ms")


def step_ms_for(window: Window) -> int:
    """The series step for ``window``: whole minutes, at least one, at most MAX_POINTS buckets.

    A day is 1440 minutes, so it gets 12-minute steps (120 points); an hour gets 1-minute
    steps (60 points).
    """
    span_ms = max(window.end_ms - window.start_ms, 1)
    minutes = math.ceil(span_ms / (MAX_POINTS * MIN_STEP_MS))
    return max(minutes, 1) * MIN_STEP_MS


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
    """A lookup that GETs JSON from the HTTP service it names (``backend_name``).

    :meth:`fetch` raises :class:`~lookups.errors.BackendUnavailable` when the service
    refuses or resets the connection or answers 5xx, :class:`~lookups.errors.BackendTimeout`
    when the budget runs out, and :class:`~lookups.errors.BadBackendResponse` on 3xx/4xx,
    a body over ``MAX_RESPONSE_BYTES``, invalid JSON or JSON of the wrong shape.
    """

    source: ClassVar[str] = "http"
    #: The backend (``[backends.<name>]``) it calls; also ``peer.service`` on its spans.
    backend_name: ClassVar[str]
    #: The path with ``{app}`` for the app: ``url.template``, and the span's name.
    route: ClassVar[str]

    def __init__(self, backend: HttpBackend) -> None:
        """``backend`` makes the call: its slots, guard and session (``Backends.http(name)``)."""
        self.backend = backend

    def _get_json(self, window: Window, params: dict[str, int], deadline: Deadline) -> Any:
        path = self.route.format(app=app_path_segment(window.app))
        return self.backend.get_json(self.name, path, params, deadline, self.route)


class AlertsLookup(HttpLookup):
    """Alerts triggered in the window, sorted by ``triggered_ms`` then ``id``."""

    name: ClassVar[str] = "alerts"
    backend_name: ClassVar[str] = "alerts"
    route: ClassVar[str] = "/apps/{app}/alerts"

    def fetch(self, window: Window, deadline: Deadline) -> AlertList:
        alerts = self.alerts(window, deadline)
        return AlertList(tuple(sorted(alerts, key=lambda a: (a.triggered_ms, a.id))))

    def alerts(self, window: Window, deadline: Deadline) -> list[Alert]:
        """The service's answer for ``window``, checked, in its order."""
        params = {"start_ms": window.start_ms, "end_ms": window.end_ms}
        body = self._get_json(window, params, deadline)
        return [
            Alert(
                id=_typed(self.name, item, "id", str),
                severity=_typed(self.name, item, "severity", str),
                title=_typed(self.name, item, "title", str),
                triggered_ms=_typed(self.name, item, "triggered_ms", int),
            )
            for item in _list_field(self.name, body, "alerts")
        ]


class SeriesLookup(HttpLookup):
    """One metric series over the window, at the step :func:`step_ms_for` chooses."""

    backend_name: ClassVar[str] = "metrics"

    def fetch(self, window: Window, deadline: Deadline) -> Series:
        step_ms = step_ms_for(window)
        params = {"start_ms": window.start_ms, "end_ms": window.end_ms, "step_ms": step_ms}
        body = self._get_json(window, params, deadline)
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
