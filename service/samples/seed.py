"""Deterministic sample data for the embedded backends, and loading it into MongoDB.

One day (SAMPLE_START_MS to SAMPLE_END_MS, from 2026-01-01T00:00:00Z) for three apps:
errors with repeated messages, requests over a dozen URLs and their controllers, SQL
queries with literals drawn from a few statement shapes, alerts, and per-minute latency
and volume samples. The same seed always gives the same records.

Record timestamps fall on whole seconds: nx-27017, the embedded MongoDB-wire server,
compares datetimes in an aggregation's ``$match`` at second precision, and whole
seconds make its answers match MongoDB's (and FerretDB's) for any window whose bounds
are whole seconds too.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pymongo
from pymongo.database import Database

from lookups.mongo import ensure_indexes

__all__ = [
    "SAMPLE_START_MS",
    "SAMPLE_END_MS",
    "APPS",
    "DEFAULT_SEED",
    "ErrorRecord",
    "RequestRecord",
    "QueryRecord",
    "AlertRecord",
    "MetricSample",
    "SampleData",
    "generate_sample_data",
    "seed_mongo",
    "seed_mongo_at",
]

SAMPLE_START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SAMPLE_END_MS = SAMPLE_START_MS + 86_400_000
APPS = ("shop", "search", "billing")
DEFAULT_SEED = 2026
_INSERT_BATCH = 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class ErrorRecord:
    app: str
    ts_ms: int
    code: int
    message: str
    url: str


@dataclass(frozen=True)
class RequestRecord:
    app: str
    ts_ms: int
    url: str
    controller: str
    duration_ms: float
    status: int


@dataclass(frozen=True)
class QueryRecord:
    """One executed statement; ``shape`` is the statement it came from, with ``?`` literals."""

    app: str
    ts_ms: int
    query: str
    duration_ms: float
    shape: str


@dataclass(frozen=True)
class AlertRecord:
    app: str
    id: str
    severity: str
    title: str
    triggered_ms: int


@dataclass(frozen=True)
class MetricSample:
    """One minute of one app: mean latency and request count."""

    app: str
    ts_ms: int
    latency_ms: float
    volume: int


@dataclass(frozen=True)
class SampleData:
    seed: int
    apps: tuple[str, ...]
    errors: tuple[ErrorRecord, ...]
    requests: tuple[RequestRecord, ...]
    queries: tuple[QueryRecord, ...]
    alerts: tuple[AlertRecord, ...]
    metrics: tuple[MetricSample, ...]


# (url, controller): fourteen URLs, so the top-10 cut matters; several share a controller.
_ROUTES = (
    ("/", "HomeController"),
    ("/search", "SearchController"),
    ("/products", "ProductsController"),
    ("/products/show", "ProductsController"),
    ("/cart", "CartController"),
    ("/cart/add", "CartController"),
    ("/checkout", "CheckoutController"),
    ("/login", "SessionsController"),
    ("/logout", "SessionsController"),
    ("/account", "AccountController"),
    ("/orders", "OrdersController"),
    ("/orders/show", "OrdersController"),
    ("/api/health", "HealthController"),
    ("/invoices", "InvoicesController"),
)
_ERROR_MESSAGES = (
    "timeout calling payment gateway",
    "NoMethodError: undefined method 'price' for nil",
    "deadlock detected",
    "connection reset by peer",
    "invalid CSRF token",
    "record not found",
    "rate limit exceeded",
    "cannot serialize cart",
    "upstream returned 502",
    "disk quota exceeded",
    "session expired",
    "invalid coupon code",
    "template missing: orders/show",
)
# Shapes exactly as normalisation should print them; each "?" is filled with a literal
# of the listed kind: n (integer), f (decimal), s (quoted string), ns (integer list).
_QUERY_SHAPES = (
    ("SELECT * FROM orders WHERE id = ?", ("n",)),
    ("SELECT * FROM users WHERE email = ?", ("s",)),
    ("SELECT * FROM products WHERE id IN (?)", ("ns",)),
    ("UPDATE carts SET qty = ? WHERE id = ?", ("n", "n")),
    ("INSERT INTO events (kind, amount) VALUES (?, ?)", ("s", "f")),
    ("SELECT id FROM audit_2025 WHERE user_id = ? AND action = ?", ("n", "s")),
    ("DELETE FROM sessions WHERE expires_at < ?", ("n",)),
    ("SELECT count(*) FROM invoices WHERE status = ? AND total > ?", ("s", "f")),
    ("SELECT * FROM coupons WHERE code = ?", ("s",)),
    ("SELECT name FROM categories WHERE parent_id = ?", ("n",)),
    ("UPDATE users SET last_seen = ? WHERE id = ?", ("n", "n")),
    ("SELECT * FROM stock WHERE sku IN (?) AND warehouse = ?", ("ns", "s")),
)
_WORDS = ("alice@example.com", "bob", "O''Brien", "paid", "pending", "SAVE10", "eu-west", "login")
_ALERT_TITLES = (
    "p95 latency above 800 ms",
    "error rate above 2%",
    "queue backlog growing",
    "disk 90% full",
    "certificate expires soon",
    "5xx spike",
)


def generate_sample_data(seed: int = DEFAULT_SEED) -> SampleData:
    """The sample records for ``seed``; the same seed gives equal data on every run."""
    rng = random.Random(seed)
    parts: dict[str, list[Any]] = {
        "errors": [],
        "requests": [],
        "queries": [],
        "alerts": [],
        "metrics": [],
    }
    for index, app in enumerate(APPS):
        parts["requests"] += _requests(rng, app, count=1200 - 300 * index)
        parts["errors"] += _errors(rng, app, count=150 - 40 * index)
        parts["queries"] += _queries(rng, app, count=500 - 100 * index)
        parts["alerts"] += _alerts(rng, app, count=10)
        parts["metrics"] += _metrics(rng, app, outage=(app == "billing"))
    return SampleData(
        seed=seed, apps=APPS, **{name: tuple(records) for name, records in parts.items()}
    )


def _random_ts(rng: random.Random) -> int:
    return SAMPLE_START_MS + rng.randrange(86_400) * 1000


def _weights(rng: random.Random, count: int) -> list[float]:
    return [rng.uniform(0.2, 3.0) for _ in range(count)]


def _requests(rng: random.Random, app: str, count: int) -> list[RequestRecord]:
    routes = _ROUTES[: 10 + len(app) % 5]
    weights = _weights(rng, len(routes))
    base_ms = {route: rng.uniform(20, 300) for route in routes}
    picked = rng.choices(routes, weights, k=count)
    return [
        RequestRecord(
            app,
            _random_ts(rng),
            url,
            controller,
            round(rng.lognormvariate(0, 0.5) * base_ms[(url, controller)], 1),
            500 if rng.random() < 0.03 else 200,
        )
        for url, controller in picked
    ]


def _errors(rng: random.Random, app: str, count: int) -> list[ErrorRecord]:
    weights = _weights(rng, len(_ERROR_MESSAGES))
    picked = rng.choices(_ERROR_MESSAGES, weights, k=count)
    return [
        ErrorRecord(
            app, _random_ts(rng), rng.choice((500, 502, 503, 422)), message, rng.choice(_ROUTES)[0]
        )
        for message in picked
    ]


def _literal(rng: random.Random, kind: str) -> str:
    if kind == "n":
        return str(rng.randrange(1, 100_000))
    if kind == "f":
        return f"{rng.uniform(0, 500):.2f}"
    if kind == "s":
        return f"'{rng.choice(_WORDS)}'"
    return ", ".join(str(rng.randrange(1, 5000)) for _ in range(rng.randrange(1, 6)))


def _queries(rng: random.Random, app: str, count: int) -> list[QueryRecord]:
    weights = _weights(rng, len(_QUERY_SHAPES))
    records = []
    for shape, kinds in rng.choices(_QUERY_SHAPES, weights, k=count):
        pieces = shape.split("?")
        query = pieces[0] + "".join(
            _literal(rng, kind) + piece for kind, piece in zip(kinds, pieces[1:])
        )
        if rng.random() < 0.2:
            query = query.replace(" WHERE ", "\n    WHERE ")  # as an ORM might indent it
        records.append(
            QueryRecord(app, _random_ts(rng), query, round(rng.lognormvariate(1.5, 0.8), 2), shape)
        )
    return records


def _alerts(rng: random.Random, app: str, count: int) -> list[AlertRecord]:
    alerts = [
        AlertRecord(
            app,
            f"{app}-{number:03d}",
            rng.choice(("critical", "warning", "info")),
            rng.choice(_ALERT_TITLES),
            _random_ts(rng),
        )
        for number in range(count)
    ]
    # Two alerts at the same instant, listed out of id order, so ordering by id is exercised.
    tied = AlertRecord(app, f"{app}-001a", "warning", "5xx spike", alerts[1].triggered_ms)
    return [tied, *alerts]


def _metrics(rng: random.Random, app: str, outage: bool) -> list[MetricSample]:
    samples = []
    for minute in range(1440):
        if outage and 180 <= minute < 215:
            continue  # no samples while the app was down: those buckets have no point
        samples.append(
            MetricSample(
                app,
                SAMPLE_START_MS + minute * 60_000,
                round(rng.uniform(40, 400), 2),
                rng.randrange(0, 120),
            )
        )
    return samples


def _as_datetime(epoch_ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=epoch_ms)


def _documents(data: SampleData) -> dict[str, Iterable[dict[str, Any]]]:
    return {
        "errors": (
            {
                "app": r.app,
                "ts": _as_datetime(r.ts_ms),
                "code": r.code,
                "message": r.message,
                "url": r.url,
            }
            for r in data.errors
        ),
        "requests": (
            {
                "app": r.app,
                "ts": _as_datetime(r.ts_ms),
                "url": r.url,
                "controller": r.controller,
                "duration_ms": r.duration_ms,
                "status": r.status,
            }
            for r in data.requests
        ),
        "queries": (
            {
                "app": r.app,
                "ts": _as_datetime(r.ts_ms),
                "query": r.query,
                "duration_ms": r.duration_ms,
            }
            for r in data.queries
        ),
    }


def seed_mongo(db: Database[Any], data: SampleData) -> None:
    """Drop the lookup collections in ``db``, insert ``data`` in batches, create indexes."""
    for name, documents in _documents(data).items():
        db.drop_collection(name)
        _insert_in_batches(db[name], list(documents))
    ensure_indexes(db)


def _insert_in_batches(collection: Any, documents: Sequence[dict[str, Any]]) -> None:
    for start in range(0, len(documents), _INSERT_BATCH):
        collection.insert_many(documents[start : start + _INSERT_BATCH], ordered=False)


def seed_mongo_at(uri: str, database: str, data: SampleData, timeout_s: float = 30.0) -> None:
    """Seed the server at ``uri``, all within ``timeout_s`` (raises pymongo's errors)."""
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(
        uri, serverSelectionTimeoutMS=5000, appname="fanout-seed"
    )
    try:
        with pymongo.timeout(timeout_s):
            seed_mongo(client[database], data)
    finally:
        client.close()
