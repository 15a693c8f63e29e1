"""The ``[backends.<name>]`` tables: one per backend, MongoDB or HTTP, and the aliases.

Each table names its ``kind`` and holds everything of that backend: where it is,
its pool, its timeouts, TLS, its retry budget and circuit breaker::

    [backends.mongo]
    kind = "mongo"
    uri = "mongodb://db-0.db:27017/?replicaSet=rs0"
    database = "apm"
    pool_size = 32

    [backends.slow_jobs]             # a plugin's service: its own pool, breaker and probe
    kind = "http"
    url = "http://jobs.internal:8080"
    pool_size = 8

The built-in panels use the backends ``mongo``, ``alerts`` and ``metrics``. For one
release, the older sections still define them when no table of that name does:
``[mongo]`` is ``[backends.mongo]``, and ``[http]`` with ``alerts_url`` and
``metrics_url`` is ``[backends.alerts]`` and ``[backends.metrics]`` sharing its other keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lookups.settings import (
    HttpOptions,
    HttpSettings,
    MongoOptions,
    MongoSettings,
    Resilience,
    check_url,
)

__all__ = [
    "MongoBackendSettings",
    "HttpBackendSettings",
    "BackendSettings",
    "BACKEND_KINDS",
    "ALIAS_SECTIONS",
    "backends_from_aliases",
]

# Keys both kinds have, meaning the same.
_KIND_HELP = "`mongo` or `http` (required)"
_POOL_SIZE_HELP = (
    "calls in flight at most (MongoDB: one fewer, the health check's connection is the last)"
)


@dataclass(frozen=True)
class MongoBackendSettings(MongoOptions, Resilience):
    """A MongoDB backend: its URI (TLS options included), database, pool and timeouts."""

    kind: str = field(default="mongo", metadata={"help": _KIND_HELP, "choices": ("mongo",)})
    pool_size: int = field(default=32, metadata={"help": _POOL_SIZE_HELP, "min": 1})

    def __post_init__(self) -> None:
        self._check_resilience()


@dataclass(frozen=True)
class HttpBackendSettings(HttpOptions, Resilience):
    """An HTTP service: its base URL and pool; timeouts, bearer token and TLS files."""

    kind: str = field(default="http", metadata={"help": _KIND_HELP, "choices": ("http",)})
    url: str = field(
        default="http://127.0.0.1:8081",
        metadata={"help": "base URL; lookups call paths under it only"},
    )
    pool_size: int = field(default=32, metadata={"help": _POOL_SIZE_HELP, "min": 1})
    health_path: str = field(
        default="",
        metadata={
            "help": "the health check's path under `url` (empty: `url` itself); a `2xx` or `3xx` "
            "answer there is up, anything else down (a `404`: nothing at that URL)"
        },
    )

    def __post_init__(self) -> None:
        check_url("url", self.url)
        if self.health_path and not self.health_path.startswith("/"):
            raise ValueError(f"health_path: must start with /, got {self.health_path!r}")
        self._check_http_options()
        self._check_resilience()


BackendSettings = MongoBackendSettings | HttpBackendSettings

#: ``kind`` -> the settings class of a ``[backends.<name>]`` table.
BACKEND_KINDS: Mapping[str, type] = MappingProxyType(
    {"mongo": MongoBackendSettings, "http": HttpBackendSettings}
)


#: The backends :func:`backends_from_aliases` defines, and the older section each comes from.
ALIAS_SECTIONS: Mapping[str, str] = MappingProxyType(
    {"mongo": "mongo", "alerts": "http", "metrics": "http"}
)


def backends_from_aliases(mongo: MongoSettings, http: HttpSettings) -> dict[str, BackendSettings]:
    """The backends ``mongo``, ``alerts`` and ``metrics`` as ``[mongo]`` and ``[http]`` define
    them."""
    shared: dict[str, Any] = dict(
        pool_size=http.pool_maxsize,
        connect_timeout_ms=http.connect_timeout_ms,
        read_timeout_ms=http.read_timeout_ms,
        auth_token=http.auth_token,
        ca_file=http.ca_file,
        client_cert_file=http.client_cert_file,
        client_key_file=http.client_key_file,
        retry_budget_ratio=http.retry_budget_ratio,
        breaker_failures=http.breaker_failures,
        breaker_failure_rate=http.breaker_failure_rate,
        breaker_open_ms=http.breaker_open_ms,
    )
    return {
        "mongo": MongoBackendSettings(
            uri=mongo.uri,
            database=mongo.database,
            pool_size=mongo.max_pool_size,
            connect_timeout_ms=mongo.connect_timeout_ms,
            server_selection_timeout_ms=mongo.server_selection_timeout_ms,
            retry_budget_ratio=mongo.retry_budget_ratio,
            breaker_failures=mongo.breaker_failures,
            breaker_failure_rate=mongo.breaker_failure_rate,
            breaker_open_ms=mongo.breaker_open_ms,
        ),
        "alerts": HttpBackendSettings(url=http.alerts_url, **shared),
        "metrics": HttpBackendSettings(url=http.metrics_url, **shared),
    }
