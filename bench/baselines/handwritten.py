"""Hand-written gevent baseline: what a team would write with the same libraries in an afternoon.

A gevent ``StreamServer`` running the thriftpy2 processor loop (as :mod:`bench.baselines.bare`),
and a ``get_app_stats`` that spawns one greenlet per lookup with plain ``gevent.spawn`` and
waits for them with ``gevent.joinall`` until the deadline. Each lookup is a plain library
call: ``collection.aggregate(...)`` with ``maxTimeMS``, ``session.get(..., timeout=...)``
and ``response.json()``. The queries, URLs and the parsing of the answers are Fanout's own
(the lookups' ``stages()``/``build()`` and the HTTP lookups' field checks), so the same
work is asked of the backends and the same panels come back.

Left out, as such code usually leaves them: admission control, pools of our own and slot
waits, retries and circuit breakers, budgets enforced on the whole exchange, reaping of
stragglers (a greenlet still running at the deadline is left to finish on its own), wire
limits, tracing and metrics.

    python -m bench.baselines.handwritten --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

from gevent import monkey

monkey.patch_all()

import time
from collections.abc import Sequence
from typing import Any

import gevent
import pymongo
import requests
from thriftpy2.thrift import TProcessor

from bench.baselines.bare import serve_until_stopped
from bench.baselines.common import (
    BaselineHandler,
    PlannedLookup,
    lookup_outcome,
    settings_from_argv,
    timeout_outcome,
)
from lookups.deadline import Deadline
from lookups.http import AlertsLookup, LatencyLookup, VolumeLookup, app_path_segment
from lookups.mongo import ControllersLookup, ErrorsLookup, QueriesLookup, UrlsLookup, window_filter
from lookups.panels import Window
from service.engine.tasks import TaskOutcome
from service.idl import appstats

__all__ = ["HandwrittenHandler", "main"]


def _plain_mongo(base: type) -> type:
    class Plain(base):  # type: ignore[misc]
        """The lookup's pipeline and parsing, run as one plain ``aggregate`` call."""

        def __init__(self, db: Any) -> None:  # no backend: a plain pymongo database
            self._db = db

        def fetch(self, window: Window, deadline: Deadline) -> Any:
            pipeline = [{"$match": window_filter(window)}, *self.stages()]
            documents = list(
                self._db[self.collection].aggregate(
                    pipeline, maxTimeMS=max(1, int(deadline.remaining_ms()))
                )
            )
            return self.build(documents)

    return Plain


def _plain_http(base: type) -> type:
    class Plain(base):  # type: ignore[misc]
        """The lookup's URL and parsing, fetched with one plain ``session.get``."""

        def __init__(self, session: requests.Session, base_url: str) -> None:  # no backend
            self._session = session
            self._base_url = base_url.rstrip("/")

        def _get_json(self, window: Window, params: dict[str, int], deadline: Deadline) -> Any:
            path = self.route.format(app=app_path_segment(window.app))
            response = self._session.get(
                self._base_url + path, params=params, timeout=max(deadline.remaining_s(), 0.001)
            )
            response.raise_for_status()
            return response.json()

    return Plain


class HandwrittenHandler(BaselineHandler):
    """One plain greenlet per lookup; whatever has not finished at the deadline is TIMEOUT."""

    def gather(
        self, window: Window, planned: Sequence[PlannedLookup], deadline: Deadline
    ) -> list[TaskOutcome]:
        started = time.monotonic()
        jobs = [
            gevent.spawn(lookup_outcome, lookup, window, timeout_ms, deadline)
            for lookup, timeout_ms in planned
        ]
        gevent.joinall(jobs, timeout=deadline.remaining_s())
        return [
            job.value
            if job.ready() and job.value is not None
            else timeout_outcome(
                lookup, (time.monotonic() - started) * 1000.0, "request deadline passed"
            )
            for (lookup, _), job in zip(planned, jobs)
        ]


def _lookups(settings: Any) -> dict[str, Any]:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        settings.mongo.uri,
        maxPoolSize=settings.mongo.max_pool_size,
        connectTimeoutMS=settings.mongo.connect_timeout_ms,
        serverSelectionTimeoutMS=settings.mongo.server_selection_timeout_ms,
    )
    db = client[settings.mongo.database]
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=settings.http.pool_maxsize)
    session.mount("http://", adapter)
    lookups: dict[str, Any] = {}
    for lookup in (ErrorsLookup, UrlsLookup, ControllersLookup, QueriesLookup):
        lookups[lookup.name] = _plain_mongo(lookup)(db)
    for http_lookup in (AlertsLookup, LatencyLookup, VolumeLookup):
        lookups[http_lookup.name] = _plain_http(http_lookup)(
            session, settings.backends[http_lookup.backend_name].url
        )
    return lookups


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.handwritten", argv)
    processor = TProcessor(appstats.AppStats, HandwrittenHandler(settings, _lookups(settings)))
    return serve_until_stopped(settings, processor, "handwritten")


if __name__ == "__main__":
    raise SystemExit(main())
