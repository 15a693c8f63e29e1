"""Our own MongoDB command spans (:func:`tracing.clients.mongo_command_span`) against the
official pymongo instrumentation's, for the same commands on a real MongoDB-wire server:
the same names, kinds, parents and attributes, on success and on a command the server
fails; and none at all outside a recording span."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.pymongo import PymongoInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import tracing.clients as clients
from lookups.mongo import aggregate_one_batch, first_batch
from tracing.clients import own_mongo_spans, pymongo_request_hook, remote_call

Command = Callable[[Any], Any]


@pytest.fixture
def uri(mongo_server: Any) -> str:
    found: str = mongo_server.uri
    return found


class Side:
    """A provider of its own, and the spans it finished."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))


@pytest.fixture(scope="module")
def official() -> Iterator[Side]:
    """The official instrumentation, on for this module: it keeps the provider its first
    ``instrument()`` was given for the rest of the process, so it is given one, once."""
    side = Side()
    instrumentor = PymongoInstrumentor()
    instrumentor.instrument(tracer_provider=side.provider, request_hook=pymongo_request_hook)
    try:
        yield side
    finally:
        instrumentor.uninstrument()


def traced(command: Command, uri: str, side: Side, ours: bool) -> list[Any]:
    """The CLIENT spans ``command(database)`` makes under a recording span of ``side``'s
    provider: ours (the official instrumentation's listener on, but not enabled), or the
    official instrumentation's (ours off), on a client made for it (the instrumentation's
    listener reaches only the clients made after it)."""
    side.exporter.clear()
    instrumentor = PymongoInstrumentor()
    if ours:
        instrumentor.uninstrument()
    else:
        own_mongo_spans(False)
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        uri, connectTimeoutMS=5000, socketTimeoutMS=5000, serverSelectionTimeoutMS=5000
    )
    try:
        client.admin.command("ping")  # connected before the span: only the command is traced
        with side.provider.get_tracer("test").start_as_current_span("task"), _through(side):
            _run(command, client["apm"])
    finally:
        client.close()
        own_mongo_spans(True)
        if ours:
            instrumentor.instrument(tracer_provider=side.provider)
    return [
        span
        for span in side.exporter.get_finished_spans()
        if span.kind is SpanKind.CLIENT and span.parent is not None
    ]


def _run(command: Command, database: Any) -> None:
    try:
        command(database)
    except pymongo.errors.OperationFailure:
        pass


class _through:
    """Route tracing.clients' tracer (the global provider's) to ``provider`` for a block."""

    def __init__(self, side: Side) -> None:
        self._provider = side.provider

    def __enter__(self) -> None:
        self._saved = clients._tracer
        clients._tracer = self._provider.get_tracer("fanout.clients")

    def __exit__(self, *exc: Any) -> None:
        clients._tracer = self._saved


def shape(span: Any) -> tuple[Any, ...]:
    return (span.name, span.kind, dict(span.attributes), span.status.status_code)


COMMANDS: dict[str, Command] = {
    "aggregate": lambda db: first_batch(db, "errors", [{"$match": {"app": "shop"}}], 5),
    "aggregate in batches": lambda db: aggregate_one_batch(db, "urls_missing", [{"$limit": 1}]),
    "failed": lambda db: first_batch(db, "errors", [{"$nosuchstage": {}}], 5),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_our_command_spans_are_the_official_instrumentations(
    uri: str, official: Side, name: str
) -> None:
    ours = traced(COMMANDS[name], uri, official, ours=True)
    theirs = traced(COMMANDS[name], uri, official, ours=False)
    assert ours, "no span of ours"
    assert [shape(span) for span in ours] == [shape(span) for span in theirs]
    assert ours[0].attributes["db.collection.name"] in ("errors", "urls_missing")


def test_a_failed_command_span_says_why_as_the_official_one_does(uri: str, official: Side) -> None:
    [span] = traced(COMMANDS["failed"], uri, official, ours=True)
    assert span.status.status_code is trace.StatusCode.ERROR and span.status.description
    assert span.attributes["error.type"]


def test_a_named_call_sets_the_peer_service(uri: str, official: Side) -> None:
    def named(db: Any) -> Any:
        with remote_call("orders-db"):
            return first_batch(db, "errors", [{"$limit": 1}], 5)

    [ours] = traced(named, uri, official, ours=True)
    [theirs] = traced(named, uri, official, ours=False)
    assert ours.attributes["peer.service"] == theirs.attributes["peer.service"] == "orders-db"


def test_no_span_is_made_outside_a_recording_span(uri: str, spans: Any) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(uri)
    try:
        first_batch(client["apm"], "errors", [{"$limit": 1}], 5)  # no span current
    finally:
        client.close()
    assert [span for span in spans.get_finished_spans() if span.kind is SpanKind.CLIENT] == []
