"""The alerts panel from cached buckets, against the sample alerts service over real HTTP.

Windows aligned or not, empty, inside one bucket, across many, and reaching past the
settled buckets: the cached answer always equals the service's answer for the window,
and a warm window costs one call, for its unsettled end, or none.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs

import gevent
import pytest

from lookups.backends.collection import Backends
from lookups.cache.alerts import CachedAlerts
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import MemoryStore
from lookups.cache.wiring import with_cache
from lookups.deadline import Deadline
from lookups.http import AlertsLookup, LatencyLookup
from lookups.panels import Window
from service.samples import SampleData, SampleHttpServices
from service.samples.seed import AlertRecord
from service.settings.config import load_settings
from service.testing import FakeClock

HOUR_MS = 3_600_000
BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00Z: a multiple of every bucket below
NOW_MS = BASE_MS + 6 * HOUR_MS  # the cache's clock


@pytest.fixture(scope="module")
def alerts_service(
    sample_data: SampleData,
) -> Iterator[tuple[SampleHttpServices, list[dict[str, Any]]]]:
    """The sample services over 400 alerts of ``shop`` in six hours, some on the hour; and
    the query of every call the alerts service answered."""
    rng = random.Random(5)
    alerts = [
        AlertRecord("shop", f"a{i}", "warning", f"alert {i}", BASE_MS + rng.randrange(6 * HOUR_MS))
        for i in range(400)
    ]
    alerts += [
        AlertRecord("shop", f"b{i}", "critical", "on the hour", BASE_MS + i * HOUR_MS)
        for i in range(7)
    ]
    services = SampleHttpServices(dataclasses.replace(sample_data, alerts=tuple(alerts)))
    calls: list[dict[str, Any]] = []
    answer = services.alerts.answer

    def counted(segments: list[str], environ: dict[str, Any]) -> Any:
        calls.append(
            {key: int(values[0]) for key, values in parse_qs(environ["QUERY_STRING"]).items()}
        )
        return answer(segments, environ)

    services.alerts.answer = counted  # type: ignore[method-assign]
    with services:
        yield services, calls


@pytest.fixture
def backends(alerts_service: tuple[SampleHttpServices, Any]) -> Iterator[Backends]:
    services, _ = alerts_service
    settings = load_settings(
        env={},
        overrides={
            "http.alerts_url": services.alerts_url,
            "http.metrics_url": services.metrics_url,
        },
    )
    with Backends(settings.backends) as opened:
        yield opened


def _cached(backends: Backends, bucket_ms: int, settle_ms: int) -> CachedAlerts:
    lookups = {
        "alerts": AlertsLookup(backends.http("alerts")),
        "latency": LatencyLookup(backends.http("metrics")),
    }
    cached = with_cache(
        lookups,
        CacheSettings(enabled=True, bucket_ms=bucket_ms, settle_ms=settle_ms),
        MemoryStore(1 << 24),
    )
    assert (
        cached["latency"] is lookups["latency"]
    )  # a series is not split (lookups/cache/alerts.py)
    alerts = cached["alerts"]
    assert isinstance(alerts, CachedAlerts)
    alerts._clock = FakeClock(wall_start=NOW_MS / 1000)
    return alerts


WINDOWS = [
    (0, 6 * HOUR_MS),
    (1_234, 5 * HOUR_MS + 777),
    (HOUR_MS, HOUR_MS),
    (HOUR_MS, 2 * HOUR_MS),
    (HOUR_MS + 5, HOUR_MS + 900_000),
    (-HOUR_MS, HOUR_MS + 1),
    (2 * HOUR_MS - 1, 7 * HOUR_MS),
    (5 * HOUR_MS + 600_000, 6 * HOUR_MS),
]


@pytest.mark.parametrize(
    "bucket_ms, settle_ms", [(HOUR_MS, 0), (600_000, 300_000), (900_000, 120_000)]
)
def test_alerts_from_buckets_equal_the_services_answer(
    backends: Backends, bucket_ms: int, settle_ms: int
) -> None:
    lookup = _cached(backends, bucket_ms, settle_ms)
    for start, end in WINDOWS:
        window = Window("shop", BASE_MS + start, BASE_MS + end)
        direct = lookup.inner.fetch(window, Deadline.after_ms(10_000))
        for _ in range(2):  # cold, then warm
            assert lookup.fetch(window, Deadline.after_ms(10_000)) == direct, (start, end)
    assert lookup.store.stats.hits > 0 and lookup.store.stats.fills > 0


def test_a_warm_window_asks_only_for_its_unsettled_end(
    backends: Backends, alerts_service: tuple[Any, list[dict[str, Any]]]
) -> None:
    _, calls = alerts_service
    lookup = _cached(backends, 900_000, 120_000)
    sliding = Window("shop", BASE_MS + 1_234, NOW_MS)
    lookup.fetch(sliding, Deadline.after_ms(10_000))
    del calls[:]
    answer = lookup.fetch(sliding, Deadline.after_ms(10_000))
    settled = NOW_MS - 120_000 - (NOW_MS - 120_000) % 900_000
    assert calls == [{"start_ms": settled, "end_ms": NOW_MS}]
    assert answer == lookup.inner.fetch(sliding, Deadline.after_ms(10_000))
    del calls[:]
    lookup.fetch(Window("shop", BASE_MS + 1_234, BASE_MS + HOUR_MS + 5), Deadline.after_ms(10_000))
    assert calls == []  # settled and cached: cut from its buckets, no call


def test_fifty_callers_arriving_together_fill_each_bucket_once(
    backends: Backends, alerts_service: tuple[Any, list[dict[str, Any]]]
) -> None:
    _, calls = alerts_service
    lookup = _cached(backends, 900_000, 120_000)
    window = Window("shop", BASE_MS + 1_234, BASE_MS + 4 * HOUR_MS)  # settled: no unsettled end
    del calls[:]
    callers = [gevent.spawn(lookup.fetch, window, Deadline.after_ms(10_000)) for _ in range(50)]
    gevent.joinall(callers, raise_error=True)
    assert calls == [{"start_ms": BASE_MS, "end_ms": BASE_MS + 4 * HOUR_MS}]
    direct = lookup.inner.fetch(window, Deadline.after_ms(10_000))
    assert all(caller.value == direct for caller in callers)
    assert lookup.store.stats.fills == 16 and lookup.store.stats.misses == 50 * 16
