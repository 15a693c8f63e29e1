"""The probe and metrics endpoints of a pre-forked server: one of each for the group.

With ``server.workers`` > 1 the master, not the workers, owns
``server.probe_port`` and the Prometheus port. It binds them at start, before
any worker exists, so a port that cannot be bound fails ``fanout serve`` at
once with the address in the error, and keeps them across reloads and
restarts, so no two processes ever want the same port. The master's event loop
runs no calls, so it answers under any load on the workers.

* ``GET /healthz``: 200 while the master runs; the body gives each worker position's
  state (``serving``; ``unresponsive`` while its event loop misses beats, until the
  master kills it; ``starting``, ``restarting``) and the backends as the master
  last checked them (:mod:`service.workers.group_state`). A stuck worker is the
  master's to kill and replace (heartbeats), not the kubelet's.
* ``GET /readyz``: 200 while at least one worker serves (after a reload, an old one
  until the new ones serve); 503 ``starting`` before
  the first does, and 503 ``draining`` from SIGTERM on; the same body.
* ``GET /metrics`` (on the Prometheus port): every serving worker's scrape,
  fetched in parallel from the port it announced (127.0.0.1, a free port each,
  served off its event loop: ``service.operations.metrics_endpoint``), merged into one
  exposition with a ``worker`` label (the position) on every sample, plus
  ``fanout_worker_scraped{worker}`` (1, or 0 for a worker that did not answer
  within :data:`WORKER_SCRAPE_TIMEOUT_S`, whose last answer is given again, so
  that no series goes stale while a worker restarts or stalls) and
  ``fanout_worker_connections{worker}``. One target per pod; a replaced worker's
  counters restart from 0 under the same label, which ``rate()`` reads as a
  counter reset.

The master's ports are its own: workers are started as programs of their own and
inherit none of its descriptors, so a keep-alive scrape or probe connection is
only ever answered here.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import gevent
from gevent.pywsgi import WSGIServer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric

from service.operations.ports import cannot_listen
from service.operations.probes import backend_bodies, json_answer
from service.workers.counts import GroupCounts

if TYPE_CHECKING:
    from service.workers.group_state import GroupState

__all__ = [
    "GROUP_SERIES",
    "GroupEndpoints",
    "ScrapeTarget",
    "WorkerState",
    "merge_scrapes",
    "WORKER_SCRAPE_TIMEOUT_S",
]

log = logging.getLogger(__name__)

#: How long the master waits for a worker's scrape (a worker's own collection gives up at 500 ms).
WORKER_SCRAPE_TIMEOUT_S = 0.75

#: (position, state, where its metrics are scraped or None); state: serving, unresponsive,
#: starting, restarting.
WorkerState = tuple[int, str, str | None]


class ScrapeTarget(NamedTuple):
    """A running worker that serves its metrics: the position it holds, who it is, where."""

    position: int
    pid: int
    serial: int
    url: str


class GroupEndpoints:
    """Serve the group's probes and metrics from the master; :meth:`start` binds both.

    ``workers`` says each position's state now; ``stopping`` whether SIGTERM arrived;
    ``targets`` where every running worker (an old one after a reload too) is scraped;
    ``ledger`` keeps their counts across lifetimes; ``counts`` the workers configured
    and the worker exits so far.
    """

    def __init__(
        self,
        host: str,
        probe_port: int,
        scrape_at: tuple[str, int] | None,
        workers: Callable[[], list[WorkerState]],
        stopping: Callable[[], bool],
        state: GroupState,
        targets: Callable[[], list[ScrapeTarget]],
        ledger: GroupCounts,
        old_serving: Callable[[], bool] = lambda: False,
        counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self._workers = workers
        self._counts = counts
        self._stopping = stopping
        self._state = state
        self._old_serving = old_serving
        self._targets = targets
        self._ledger = ledger
        self._servers: list[WSGIServer] = []
        if probe_port >= 0:
            self._servers.append(
                WSGIServer((host, probe_port), self._probes, log=None, error_log=None)
            )
        if scrape_at is not None:
            self._servers.append(WSGIServer(scrape_at, self._metrics, log=None, error_log=None))

    def start(self) -> GroupEndpoints:
        """Bind and serve; raises OSError naming the address that cannot be bound."""
        for server in self._servers:
            try:
                server.start()
            except OSError as exc:
                self.stop()
                host, port = server.address[:2]
                raise cannot_listen(host, port, exc) from exc
            log.info(
                "master: group %s on http://%s:%d",
                "metrics" if server.application == self._metrics else "probes",
                *server.address[:2],
            )
        return self

    def stop(self) -> None:
        for server in self._servers:
            if server.started:
                server.stop(timeout=1.0)

    def _probes(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        workers = {str(position): state for position, state, _ in self._workers()}
        body = {"workers": workers, "backends": backend_bodies(self._state.statuses())}
        if path == "/healthz":
            return json_answer(start_response, 200, {"status": "ok", **body})
        if path == "/readyz":
            if self._stopping():
                return json_answer(start_response, 503, {"status": "draining", **body})
            # After a reload the old generation serves until the new one does.
            serving = "serving" in workers.values() or self._old_serving()
            return json_answer(
                start_response,
                200 if serving else 503,
                {"status": "ready" if serving else "starting", **body},
            )
        return json_answer(start_response, 404, {"status": "not found"})

    def _metrics(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the scrape path is /metrics\n"]
        targets = self._targets()
        fetches = [gevent.spawn(_fetch, target.url) for target in targets]
        gevent.joinall(fetches, timeout=WORKER_SCRAPE_TIMEOUT_S)
        answered = set()
        for target, fetch in zip(targets, fetches):
            fetch.kill(block=False)  # urllib in the master: no pool to corrupt
            if fetch.value:
                self._ledger.scraped(target.serial, str(target.position), fetch.value)
                answered.add(str(target.position))
        scraped = {str(position): str(position) in answered for position, _, _ in self._workers()}
        body = merge_scrapes(self._ledger, scraped, self._state.connections(), self._counts())
        start_response(
            "200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))]
        )
        return [body]


def _fetch(url: str) -> str | None:
    """A worker's scrape, or None when it does not answer (counted in fanout_worker_scraped)."""
    try:
        with urllib.request.urlopen(url, timeout=WORKER_SCRAPE_TIMEOUT_S) as answer:
            body: bytes = answer.read()
            return body.decode()
    except (OSError, ValueError):
        return None


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


#: The series the master writes itself into the merged scrape: (name, help, type).
GROUP_SERIES = (
    ("fanout_worker_scraped", "The worker answered the master's scrape: 1 yes, 0 no", "gauge"),
    ("fanout_worker_connections", "Thrift connections the worker serves", "gauge"),
    ("fanout_workers_configured", "Workers the group runs when whole (server.workers)", "gauge"),
    ("fanout_worker_exits", "Workers that exited or were killed, and were restarted", "counter"),
)


def merge_scrapes(
    ledger: GroupCounts,
    scraped: dict[str, bool],
    connections: dict[str, int] | None = None,
    workers: tuple[int, int] = (0, 0),
) -> bytes:
    """One exposition: every position's series from ``ledger``, labelled ``worker``, whether
    each position's worker ``scraped`` now, each worker's connections as the master counts
    them, and the group's ``(workers configured, worker exits)``."""
    scraped_now, held, configured, exits = (Metric(*series) for series in GROUP_SERIES)
    configured.add_sample(configured.name, {}, float(workers[0]))
    exits.add_sample(exits.name + "_total", {}, float(workers[1]))
    for worker, count in sorted((connections or {}).items()):
        held.add_sample(held.name, {"worker": worker}, float(count))
    for worker, answered in scraped.items():
        scraped_now.add_sample(scraped_now.name, {"worker": worker}, float(answered))
    own = generate_latest(_Families([scraped_now, held, configured, exits]))
    return own + ledger.exposition("worker").encode()
