"""The alerts panel from cached buckets of alerts and one call for the unsettled end.

The alerts service answers the alerts triggered in ``[start_ms, end_ms)``: a pure
function of the window, and each alert falls in exactly one bucket by its
``triggered_ms``. So a settled bucket's alerts are cached whole, and a window that holds
a whole settled bucket (as a MongoDB panel's must) is the alerts of the buckets it
touches with ``triggered_ms`` inside it: the start edge is cut
from its cached bucket, not asked for; only the newest, unsettled stretch is a call,
shorter than the window it replaces. Missing buckets are filled by one call per run of
them, split here by ``triggered_ms``, and shared by the callers missing the same run.

The series services are not split: a series' points are buckets of the window anchored
at its start (``start_ms + k * step_ms``), and the latency is a mean without its count,
so no set of cached buckets gives the points of a window that starts anywhere else.
"""

from __future__ import annotations

import json
from functools import partial

from lookups.cache.buckets import bucket_runs, plan_buckets
from lookups.cache.panel import CachedPanel
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import BucketStore
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.errors import BadBackendResponse
from lookups.http import MAX_ITEMS, AlertsLookup
from lookups.panels import Alert, AlertList, Window

__all__ = ["CachedAlerts", "MAX_BUCKETS"]

#: Buckets a window may touch and still be read from the cache (a month of 15 minutes).
MAX_BUCKETS = 3000


class CachedAlerts(CachedPanel):
    """``inner``'s alerts from cached buckets; ``inner`` itself answers fresh calls."""

    def __init__(
        self,
        inner: AlertsLookup,
        store: BucketStore,
        settings: CacheSettings,
        namespace: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(
            inner, store, settings, f"fanout:alerts-v1:{namespace}:{settings.bucket_ms}", clock
        )
        self.inner: AlertsLookup = inner

    def fetch(self, window: Window, deadline: Deadline) -> AlertList:
        step, settled_before_ms = self._bucket_ms, self._settled_before_ms()
        if not plan_buckets(window.start_ms, window.end_ms, step, settled_before_ms).buckets:
            return self.inner.fetch(window, deadline)  # no whole settled bucket: as the others
        first = window.start_ms - window.start_ms % step
        # The buckets touching the window that are settled; the rest of it is one call.
        last = min(settled_before_ms - settled_before_ms % step, -(-window.end_ms // step) * step)
        starts = list(range(first, last, step))
        if len(starts) > MAX_BUCKETS:
            return self.inner.fetch(window, deadline)
        try:
            buckets = self._buckets(window.app, starts, deadline)
            if last < window.end_ms:
                buckets.append(self.inner.alerts(Window(window.app, last, window.end_ms), deadline))
        except BadBackendResponse:  # a bucket too many for one answer: the panel's own call
            self.store.stats.direct += 1
            return self.inner.fetch(window, deadline)
        alerts = [
            alert
            for bucket in buckets
            for alert in bucket
            if window.start_ms <= alert.triggered_ms < window.end_ms
        ]
        if len(alerts) > MAX_ITEMS:
            self.store.stats.direct += 1
            return self.inner.fetch(window, deadline)
        return AlertList(tuple(sorted(alerts, key=lambda a: (a.triggered_ms, a.id))))

    def _buckets(self, app: str, starts: list[int], deadline: Deadline) -> list[list[Alert]]:
        """Each bucket's alerts, read or filled (one call per run of missing buckets)."""
        keys = [self.key(app, start) for start in starts]
        found = self.store.get_many(keys)
        buckets: dict[int, list[Alert]] = {}
        missing: list[int] = []
        for start, key in zip(starts, keys):
            alerts = _decode(found[key]) if key in found else None
            if alerts is None:
                missing.append(start)
            else:
                buckets[start] = alerts
        self._counted(len(buckets), len(missing))
        for run in bucket_runs(missing, self._bucket_ms):
            buckets.update(
                self._shared(("fill", app, run), deadline, partial(self._fill, app, run, deadline))
            )
        return [buckets[start] for start in starts]

    def _fill(self, app: str, run: tuple[int, int], deadline: Deadline) -> dict[int, list[Alert]]:
        """Ask for the alerts of the buckets of ``run``, and store each bucket's."""
        run_start, run_end = run
        filled: dict[int, list[Alert]] = {
            start: [] for start in range(run_start, run_end, self._bucket_ms)
        }
        for alert in self.inner.alerts(Window(app, run_start, run_end), deadline):
            if run_start <= alert.triggered_ms < run_end:
                filled[alert.triggered_ms - alert.triggered_ms % self._bucket_ms].append(alert)
        self.store.put_many(
            {self.key(app, start): _encode(alerts) for start, alerts in filled.items()}
        )
        self.store.stats.fills += len(filled)
        return filled


def _encode(alerts: list[Alert]) -> bytes:
    return json.dumps(
        [[a.id, a.severity, a.title, a.triggered_ms] for a in alerts], separators=(",", ":")
    ).encode()


def _decode(value: bytes) -> list[Alert] | None:
    """A bucket's alerts; None for a value this layout did not write."""
    try:
        return [
            Alert(id=i, severity=s, title=t, triggered_ms=ms) for i, s, t, ms in json.loads(value)
        ]
    except (ValueError, TypeError):
        return None
