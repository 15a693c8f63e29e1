"""The asyncio peer: what a team starting this service today would likely write instead.

uvloop's event loop, thriftpy2's own asyncio server (framed transport, binary protocol),
pymongo's ``AsyncMongoClient`` and one aiohttp session; a call is seven tasks, one per
lookup, awaited together until the deadline with ``asyncio.wait``, and those not done by
then are cancelled and answered TIMEOUT. The queries, URLs and the parsing of the
answers are Fanout's own (the lookups' ``stages()``/``build()`` and the HTTP lookups'
field checks), as in :mod:`bench.baselines.handwritten`, so the same work is asked of the
backends and the same panels come back. Requests are validated and answered as the
other baselines do (:class:`bench.baselines.common.BaselineHandler`).

Left out, as such code usually leaves them: admission control, pools of our own, retries
and circuit breakers, wire limits, tracing and metrics.

    python -m bench.baselines.asyncio_peer --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
Needs the ``bench`` extra (uvloop, aiohttp); a run's results name their versions
(``machine.packages``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import uvloop
from pymongo import AsyncMongoClient
from thriftpy2.contrib.aio.processor import TAsyncProcessor
from thriftpy2.contrib.aio.protocol.binary import TAsyncBinaryProtocolFactory
from thriftpy2.contrib.aio.server import TAsyncServer
from thriftpy2.contrib.aio.socket import TAsyncServerSocket
from thriftpy2.contrib.aio.transport.framed import TAsyncFramedTransportFactory

from bench.baselines.common import (
    CallPlanner,
    failed_outcome,
    settings_from_argv,
    timeout_outcome,
)
from bench.servers.ready import announce_ready
from lookups.backends.settings import HttpBackendSettings
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BackendUnavailable, BadBackendResponse
from lookups.http import (
    AlertsLookup,
    HttpLookup,
    LatencyLookup,
    SeriesLookup,
    VolumeLookup,
    app_path_segment,
    step_ms_for,
)
from lookups.mongo import ControllersLookup, ErrorsLookup, QueriesLookup, UrlsLookup, window_filter
from lookups.panels import Window
from service.engine.tasks import TaskOutcome, TaskStatus
from service.idl import appstats
from service.rpc.handler import to_panel_data
from service.settings.config import Settings

__all__ = ["AsyncioHandler", "AsyncLookup", "main"]

#: Reads what a lookup parses (a MongoDB cursor's documents, an HTTP body) by the deadline.
Read = Callable[[Window, Deadline], Awaitable[Any]]


class AsyncLookup:
    """One of Fanout's lookups with its I/O done the asyncio way: :meth:`fetch` awaits
    what the lookup reads, then the lookup's own code makes the panel of it."""

    def __init__(self, lookup: type[Lookup], parsing: Callable[[Any], Lookup], read: Read):
        """``parsing(value).fetch(window, deadline)`` makes ``lookup``'s panel of what
        ``read`` gave."""
        self.name, self.source = lookup.name, lookup.source
        self._parsing, self._read = parsing, read

    async def fetch(self, window: Window, deadline: Deadline) -> Any:
        value = await self._read(window, deadline)
        return self._parsing(value).fetch(window, deadline)


def _parsing_mongo(base: type) -> type:
    class Parsing(base):  # type: ignore[misc]
        """The lookup's parsing of documents already read (and its query, ``stages()``)."""

        def __init__(self, documents: Any) -> None:  # no backend: the documents are read
            self._documents = documents

        def fetch(self, window: Window, deadline: Deadline) -> Any:
            return self.build(self._documents)

    return Parsing


def _parsing_http(base: type) -> type:
    class Parsing(base):  # type: ignore[misc]
        """The lookup's field checks over a body already read."""

        def __init__(self, body: Any) -> None:  # no backend: the body is read
            self._body = body

        def _get_json(self, window: Window, params: dict[str, int], deadline: Deadline) -> Any:
            return self._body

    return Parsing


def _read_mongo(db: Any, lookup: Any) -> Read:
    async def read(window: Window, deadline: Deadline) -> Any:
        pipeline = [{"$match": window_filter(window)}, *lookup.stages()]
        cursor = await db[lookup.collection].aggregate(
            pipeline, maxTimeMS=max(1, int(deadline.remaining_ms()))
        )
        return await cursor.to_list(None)

    return read


def _read_http(session: aiohttp.ClientSession, base_url: str, lookup: HttpLookup) -> Read:
    base_url = base_url.rstrip("/")

    async def read(window: Window, deadline: Deadline) -> Any:
        params = {"start_ms": window.start_ms, "end_ms": window.end_ms}
        if isinstance(lookup, SeriesLookup):
            params["step_ms"] = step_ms_for(window)
        url = base_url + lookup.route.format(app=app_path_segment(window.app))
        try:
            async with session.get(url, params=params) as response:
                if response.status >= 500:
                    raise BackendUnavailable(f"{lookup.name}: HTTP {response.status}")
                if response.status >= 300:
                    raise BadBackendResponse(f"{lookup.name}: HTTP {response.status}")
                return await response.json(content_type=None)
        except aiohttp.ClientConnectionError as exc:
            raise BackendUnavailable(f"{lookup.name}: {exc}") from exc
        except ValueError as exc:  # aiohttp's ContentTypeError is one too, but 3xx-5xx are above
            raise BadBackendResponse(f"{lookup.name}: {exc}") from exc

    return read


async def _outcome(
    lookup: AsyncLookup, window: Window, timeout_ms: int, deadline: Deadline
) -> TaskOutcome:
    """One lookup within ``min(timeout_ms, time left)``; every failure becomes an outcome."""
    task_deadline = deadline.earlier(timeout_ms)
    started = time.monotonic()
    try:
        value = await asyncio.wait_for(
            lookup.fetch(window, task_deadline), max(task_deadline.remaining_s(), 0.0)
        )
    except TimeoutError:
        timed_out = BackendTimeout(f"{lookup.name}: no answer within the budget")
        return failed_outcome(lookup, timed_out, (time.monotonic() - started) * 1000.0)
    except Exception as exc:  # every lookup failure becomes an outcome
        return failed_outcome(lookup, exc, (time.monotonic() - started) * 1000.0)
    elapsed_ms = (time.monotonic() - started) * 1000.0
    return TaskOutcome(
        lookup.name, lookup.source, TaskStatus.OK, elapsed_ms, value=to_panel_data(value)
    )


class AsyncioHandler(CallPlanner):
    """The AppStats handler as coroutines: a task per lookup, awaited until the deadline."""

    async def ping(self) -> str:
        return "pong"

    async def panels(self) -> list[str]:
        return self.enabled_panels()

    async def health(self) -> Any:
        return self.health_now()

    async def get_app_stats(self, request: Any) -> Any:
        """Gather the requested panels. Raises ``InvalidRequest`` for bad input."""
        call = self.plan(request)
        tasks = [
            asyncio.ensure_future(_outcome(lookup, call.window, timeout_ms, call.deadline))
            for lookup, timeout_ms in call.planned
        ]
        if tasks:
            await asyncio.wait(tasks, timeout=max(call.deadline.remaining_s(), 0.0))
        elapsed_ms = (time.monotonic() - call.started) * 1000.0
        outcomes = []
        for (lookup, _), task in zip(call.planned, tasks):
            if task.done():
                outcomes.append(task.result())
            else:
                task.cancel()
                outcomes.append(timeout_outcome(lookup, elapsed_ms, "request deadline passed"))
        return call.answer(outcomes)


def _lookups(settings: Settings, db: Any, session: aiohttp.ClientSession) -> dict[str, AsyncLookup]:
    lookups: dict[str, AsyncLookup] = {}
    for mongo in (ErrorsLookup, UrlsLookup, ControllersLookup, QueriesLookup):
        parsing = _parsing_mongo(mongo)
        lookups[mongo.name] = AsyncLookup(mongo, parsing, _read_mongo(db, parsing(None)))
    for http in (AlertsLookup, LatencyLookup, VolumeLookup):
        parsing = _parsing_http(http)
        backend = settings.backends[http.backend_name]
        assert isinstance(backend, HttpBackendSettings)
        read = _read_http(session, backend.url, parsing(None))
        lookups[http.name] = AsyncLookup(http, parsing, read)
    return lookups


async def _serve(settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        settings.mongo.uri,
        maxPoolSize=settings.mongo.max_pool_size,
        connectTimeoutMS=settings.mongo.connect_timeout_ms,
        serverSelectionTimeoutMS=settings.mongo.server_selection_timeout_ms,
    )
    connector = aiohttp.TCPConnector(limit=settings.http.pool_maxsize)
    async with aiohttp.ClientSession(connector=connector) as session:
        lookups = _lookups(settings, client[settings.mongo.database], session)
        handler = AsyncioHandler(settings, lookups)
        # make_server takes port 0 for none given; the socket and server are made as it does.
        listener = TAsyncServerSocket(
            host=settings.server.host, port=settings.server.port, client_timeout=None
        )
        server = TAsyncServer(
            TAsyncProcessor(appstats.AppStats, handler),
            listener,
            itrans_factory=TAsyncFramedTransportFactory(),
            iprot_factory=TAsyncBinaryProtocolFactory(),
            loop=loop,
        )
        server.trans.listen()
        server.server = await server.trans.accept(server.handle)
        host, port = server.server.sockets[0].getsockname()[:2]
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        announce_ready(host=host, port=port, server="asyncio")
        await stop.wait()
        await server.close()
    await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.asyncio_peer", argv)
    uvloop.install()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_serve(settings, loop))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
