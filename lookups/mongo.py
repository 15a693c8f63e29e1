"""MongoDB lookups: the errors, urls, controllers and queries panels.

Each lookup runs one aggregation over one collection, filtered to the window's app and
``start <= ts < end``, and does its grouping, sorting and limiting on the server. The
task budget is pushed into the operation with :func:`pymongo.timeout` (client-side
operation timeout, which also sends ``maxTimeMS``), so pymongo gives up cleanly; see
:mod:`lookups.backends.mongo` for how the budget is kept and what each failure
is reported as. Each lookup runs on the backend it names (``backend_name``, ``mongo``).

Collections (database ``mongo.database``)::

    errors   {app, ts: datetime, code: int, message, url}
    requests {app, ts: datetime, url, controller, duration_ms, status}
    queries  {app, ts: datetime, query, duration_ms}
"""

from __future__ import annotations

import abc
import contextlib
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pymongo
import pymongo.errors
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from pymongo.database import Database

from lookups.backends.mongo import MongoBackend
from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BadBackendResponse
from lookups.panels import TOP_N, ErrorSummary, MessageCount, PanelValue, TopEntry, TopList, Window
from tracing.clients import mongo_command_span

__all__ = [
    "COLLECTIONS",
    "QUERY_GROUP_CAP",
    "ensure_indexes",
    "window_filter",
    "normalise_query",
    "aggregate_one_batch",
    "first_batch",
    "ts_range",
    "MongoLookup",
    "ErrorsLookup",
    "TopByCountLookup",
    "UrlsLookup",
    "ControllersLookup",
    "QueriesLookup",
    "RequestTops",
    "RequestTopsCommand",
    "aggregate_window",
    "top_by_count",
    "top_by_count_stages",
]

COLLECTIONS = ("errors", "requests", "queries")

# The queries panel groups raw statements on the server, keeps the QUERY_GROUP_CAP with the
# largest total time, and merges their shapes here. Past the cap the ranking is approximate.
QUERY_GROUP_CAP = 1000
# The exact types BSON decodes integers and numbers to (bool, a subclass of int, is neither).
_INTEGERS = frozenset({int, Int64})
_NUMBERS = frozenset({int, Int64, float})


def ensure_indexes(db: Database[Any]) -> None:
    """Create the ``(app, ts)`` index every lookup's ``$match`` uses; idempotent."""
    for name in COLLECTIONS:
        db[name].create_index(
            [("app", pymongo.ASCENDING), ("ts", pymongo.ASCENDING)], name="app_ts"
        )


def window_filter(window: Window) -> dict[str, Any]:
    """The ``$match`` document for ``window``: its app and ``start <= ts < end``.

    Written as an ``$and`` of single-operator conditions rather than the usual
    ``{"ts": {"$gte": start, "$lt": end}}``. Both are valid MongoDB, mean the same and
    use the ``(app, ts)`` index alike; MongoDB and FerretDB 2 answer both the same. The
    ``$and`` form is kept for nx-27017 (0.8.1), the demo's and the tests' server: in an
    ``aggregate`` its ``$match`` finds nothing for a two-operator range on one field.
    (nx-27017 also compares datetimes there to the whole second, where MongoDB uses
    milliseconds; the sample data falls on whole seconds for that reason.)
    """
    # DatetimeMS is a BSON datetime from epoch milliseconds as they are: no float
    # rounding, and no OverflowError for instants Python's datetime cannot hold.
    return {"$and": [{"app": window.app}, *ts_range(window.start_ms, window.end_ms)]}


def ts_range(start_ms: int, end_ms: int) -> list[dict[str, Any]]:
    """``start_ms <= ts < end_ms`` as the two conditions :func:`window_filter` explains."""
    return [{"ts": {"$gte": DatetimeMS(start_ms)}}, {"ts": {"$lt": DatetimeMS(end_ms)}}]


def aggregate_one_batch(
    db: Database[Any], collection: str, pipeline: list[dict[str, Any]]
) -> list[Any]:
    """The documents of an aggregation whose result fits one batch, read as one command.

    Every lookup's pipeline ends in a ``$limit`` of at most :data:`QUERY_GROUP_CAP`, so
    its result comes back in the first batch. Sent with ``Database.command`` (the command
    ``Collection.aggregate`` sends, with the database's read preference and read concern)
    it costs less CPU than ``Collection.aggregate``, which also builds a
    command cursor and a retryable read (retries are the guard's). A result needing a
    second batch (over 16 MiB) is read again through ``Collection.aggregate``."""
    found, whole = first_batch(db, collection, pipeline, QUERY_GROUP_CAP)
    if whole:
        return found
    with mongo_command_span("aggregate", db.name, collection, db.client):
        return list(db[collection].aggregate(pipeline, batchSize=QUERY_GROUP_CAP))


def first_batch(
    db: Database[Any], collection: str, pipeline: list[dict[str, Any]], size: int
) -> tuple[list[Any], bool]:
    """The first ``size`` documents of an aggregation, and whether they were all (an open
    cursor is closed)."""
    concern: dict[str, Any] = (
        {"readConcern": db.read_concern.document} if db.read_concern.document else {}
    )
    with mongo_command_span("aggregate", db.name, collection, db.client):
        cursor = db.command(
            "aggregate",
            collection,
            pipeline=pipeline,
            cursor={"batchSize": size},
            read_preference=db.read_preference,
            **concern,
        )["cursor"]
    if cursor["id"]:
        # Best effort: on a replica set the server picked may not hold it (it drops it idle).
        with (
            contextlib.suppress(pymongo.errors.PyMongoError),
            mongo_command_span("killCursors", db.name, collection, db.client),
        ):
            db.command(
                "killCursors",
                collection,
                cursors=[cursor["id"]],
                read_preference=db.read_preference,
            )
    return cursor["firstBatch"], not cursor["id"]


def aggregate_window(
    backend: MongoBackend,
    name: str,
    collection: str,
    window: Window,
    stages: list[dict[str, Any]],
    deadline: Deadline,
) -> list[Any]:
    """The documents of ``stages`` over ``collection``'s documents in ``window``, by
    ``backend`` for the lookup ``name``: guarded, retried, ended by ``deadline``."""
    if deadline.expired:
        raise BackendTimeout(f"{name}: no time left to query MongoDB", backend_fault=False)
    pipeline = [{"$match": window_filter(window)}, *stages]
    aggregate = functools.partial(aggregate_one_batch, collection=collection, pipeline=pipeline)
    return backend.run(name, aggregate, deadline)


class MongoLookup(Lookup, abc.ABC):
    """One aggregation over ``collection``; subclasses give the stages after ``$match``.

    :meth:`fetch` raises :class:`~lookups.errors.BackendUnavailable` when no server can
    be reached, :class:`~lookups.errors.BackendTimeout` when the budget runs out, and
    :class:`~lookups.errors.BadBackendResponse` when the data has the wrong shape.
    """

    source: ClassVar[str] = "mongo"
    backend_name: ClassVar[str] = "mongo"
    collection: ClassVar[str]

    def __init__(self, backend: MongoBackend) -> None:
        """``backend`` runs the aggregation: its slots, guard and client (``Backends.mongo()``)."""
        self.backend = backend

    def fetch(self, window: Window, deadline: Deadline) -> PanelValue:
        documents = aggregate_window(
            self.backend, self.name, self.collection, window, self.stages(), deadline
        )
        return self.build(documents)

    @abc.abstractmethod
    def stages(self) -> list[dict[str, Any]]:
        """The pipeline stages that follow the window's ``$match``."""

    @abc.abstractmethod
    def build(self, documents: Sequence[Any]) -> PanelValue:
        """The panel value from the aggregation's documents; BadBackendResponse if malformed."""


class ErrorsLookup(MongoLookup):
    """Total errors in the window and the TOP_N most frequent messages (ties by message)."""

    name: ClassVar[str] = "errors"
    collection: ClassVar[str] = "errors"

    def stages(self) -> list[dict[str, Any]]:
        return [
            {
                "$facet": {
                    "total": [{"$count": "n"}],
                    "top": [
                        {"$group": {"_id": "$message", "count": {"$sum": 1}}},
                        {"$sort": {"count": -1, "_id": 1}},
                        {"$limit": TOP_N},
                    ],
                }
            }
        ]

    def build(self, documents: Sequence[Any]) -> ErrorSummary:
        facets = _one_document(self.name, documents)
        totals = _field(self.name, facets, "total", list)
        total = _field(self.name, totals[0], "n", int) if totals else 0
        top = tuple(
            MessageCount(
                _field(self.name, group, "_id", str), _field(self.name, group, "count", int)
            )
            for group in _field(self.name, facets, "top", list)[:TOP_N]
        )
        return ErrorSummary(total=total, top=_sorted_by(top, lambda m: (-m.count, m.message)))


def top_by_count_stages(field: str) -> list[dict[str, Any]]:
    """The stages that group the matched ``requests`` by ``field``: the TOP_N by count."""
    return [
        {
            "$group": {
                "_id": f"${field}",
                "count": {"$sum": 1},
                "total_ms": {"$sum": "$duration_ms"},
                "mean_ms": {"$avg": "$duration_ms"},
            }
        },
        {"$sort": {"count": -1, "_id": 1}},
        {"$limit": TOP_N},
    ]


def top_by_count(lookup: str, groups: Sequence[Any]) -> TopList:
    """The panel value of :func:`top_by_count_stages`' groups; BadBackendResponse if malformed."""
    entries = tuple(
        TopEntry(
            key=_field(lookup, group, "_id", str),
            count=_field(lookup, group, "count", int),
            mean_ms=_duration(lookup, group, "mean_ms"),
            total_ms=_duration(lookup, group, "total_ms"),
        )
        for group in groups[:TOP_N]
    )
    return TopList(_sorted_by(entries, lambda e: (-e.count, e.key)))


class TopByCountLookup(MongoLookup):
    """The TOP_N values of ``field`` in ``requests`` by count, with mean and total duration."""

    collection: ClassVar[str] = "requests"
    field: ClassVar[str]

    def stages(self) -> list[dict[str, Any]]:
        return top_by_count_stages(self.field)

    def build(self, documents: Sequence[Any]) -> TopList:
        return top_by_count(self.name, documents)


class UrlsLookup(TopByCountLookup):
    name: ClassVar[str] = "urls"
    field: ClassVar[str] = "url"


class ControllersLookup(TopByCountLookup):
    name: ClassVar[str] = "controllers"
    field: ClassVar[str] = "controller"


@dataclass(frozen=True)
class RequestTops:
    """The urls and controllers panels of one window, as one command gathered them."""

    urls: TopList
    controllers: TopList


class RequestTopsCommand:
    """The urls and controllers panels by one command: a ``$facet`` of both groupings over
    the window's ``requests`` (``fanout.merge_commands``). The two panels then succeed or
    fail together (one collection, one backend, one command), and each outcome still
    names its panel. Not a panel: the handler shares one between the two tasks."""

    name: ClassVar[str] = "urls+controllers"
    #: The panels it answers, and the field each groups by.
    PANELS: ClassVar[dict[str, str]] = {
        UrlsLookup.name: UrlsLookup.field,
        ControllersLookup.name: ControllersLookup.field,
    }

    def __init__(self, backend: MongoBackend) -> None:
        self.backend = backend

    def stages(self) -> list[dict[str, Any]]:
        return [
            {"$facet": {name: top_by_count_stages(field) for name, field in self.PANELS.items()}}
        ]

    def fetch(self, window: Window, deadline: Deadline) -> RequestTops:
        """Both panels' values, or the typed failure of the one command (see MongoLookup)."""
        documents = aggregate_window(
            self.backend, self.name, "requests", window, self.stages(), deadline
        )
        facets = _one_document(self.name, documents)
        return RequestTops(
            **{name: top_by_count(name, _field(name, facets, name, list)) for name in self.PANELS}
        )


class QueriesLookup(MongoLookup):
    """The TOP_N normalised queries by total duration (ties by normalised text).

    MongoDB has no regular-expression replace stage, so the server groups raw
    statements (at most QUERY_GROUP_CAP, largest total first) and the shapes are merged
    here with :func:`normalise_query`.
    """

    name: ClassVar[str] = "queries"
    collection: ClassVar[str] = "queries"

    def stages(self) -> list[dict[str, Any]]:
        return [
            {
                "$group": {
                    "_id": "$query",
                    "count": {"$sum": 1},
                    "total_ms": {"$sum": "$duration_ms"},
                }
            },
            {"$sort": {"total_ms": -1, "_id": 1}},
            {"$limit": QUERY_GROUP_CAP},
        ]

    def build(self, documents: Sequence[Any]) -> TopList:
        merged: dict[str, tuple[int, float]] = {}
        for group in documents[:QUERY_GROUP_CAP]:
            # Up to a thousand groups per call: exact BSON types checked inline, the
            # generic checks (and their messages) only for a group that fails them.
            query: Any
            count: Any
            total: Any
            query, count, total = (
                (group.get("_id"), group.get("count"), group.get("total_ms"))  # type-checked below
                if type(group) is dict
                else (None, None, None)
            )
            if type(query) is not str or type(count) not in _INTEGERS:
                query = _field(self.name, group, "_id", str)
                count = _field(self.name, group, "count", int)
            if type(total) not in _NUMBERS:
                total = _duration(self.name, group, "total_ms")
            shape = normalise_query(query)
            known_count, known_total = merged.get(shape, (0, 0.0))
            merged[shape] = (known_count + count, known_total + total)
        entries = [
            TopEntry(
                key=shape, count=count, mean_ms=total / count if count else 0.0, total_ms=total
            )
            for shape, (count, total) in merged.items()
        ]
        return TopList(_sorted_by(entries, lambda e: (-e.total_ms, e.key))[:TOP_N])


# Single-quoted SQL strings (with '' or backslash escapes), then numbers that are not
# part of an identifier (t1) or a dotted name, then IN lists of any length, then spaces.
_QUOTED_STRING = re.compile(r"'(?:[^'\\]|\\.|'')*'")
_NUMBER = re.compile(r"(?<![\w.$])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
_IN_LIST = re.compile(r"\b(IN)\s*\(\s*\?(?:\s*,\s*\?)*\s*\)", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")


# The same raw statements come back call after call, and the regexes were the
# largest CPU cost of a whole request; the cache is bounded in entries and size.
_CACHED_STATEMENT_CHARS = 2048


def normalise_query(query: str) -> str:
    """The statement's shape: literals become ``?``, ``IN (1, 2, 3)`` becomes ``IN (?)``.

    >>> normalise_query("SELECT * FROM orders WHERE id = 4812 AND tag IN ('a', 'b')")
    'SELECT * FROM orders WHERE id = ? AND tag IN (?)'
    """
    if len(query) <= _CACHED_STATEMENT_CHARS:
        return _cached_shape(query)
    return _shape(query)


@functools.lru_cache(maxsize=8192)
def _cached_shape(query: str) -> str:
    return _shape(query)


def _shape(query: str) -> str:
    shape = _QUOTED_STRING.sub("?", query)
    shape = _NUMBER.sub("?", shape)
    shape = _IN_LIST.sub(r"\1 (?)", shape)
    return _WHITESPACE.sub(" ", shape).strip()


def _sorted_by(items: Sequence[Any], key: Any) -> tuple[Any, ...]:
    # The server already sorted; sorting again costs nothing on TOP_N items and keeps
    # the order exact even where a server breaks ties differently.
    return tuple(sorted(items, key=key))


def _one_document(lookup: str, documents: Sequence[Any]) -> dict[str, Any]:
    if len(documents) != 1 or not isinstance(documents[0], dict):
        raise BadBackendResponse(f"{lookup}: expected one $facet document, got {len(documents)}")
    return documents[0]


def _field(lookup: str, document: Any, key: str, kind: type) -> Any:
    value = document.get(key) if isinstance(document, dict) else None
    # bool is an int in Python but never a count.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadBackendResponse(
            f"{lookup}: field {key!r} is not {kind.__name__} (found {type(value).__name__})"
        )
    return value


def _duration(lookup: str, document: Any, key: str) -> float:
    value = document.get(key) if isinstance(document, dict) else None
    # MongoDB (and FerretDB 2) answer 0 for $sum and null for $avg over a group without
    # numeric durations; nx-27017 answers 0.0 for both. Null is read as 0.0.
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadBackendResponse(
            f"{lookup}: field {key!r} is not a number (found {type(value).__name__})"
        )
    return float(value)
