"""The lookups' settings sections: ``[lookups.<name>]``, and the older ``[mongo]`` and
``[http]``, kept as aliases of ``[backends.mongo]``, ``[backends.alerts]`` and
``[backends.metrics]`` for one release (:mod:`lookups.backends.settings`).

Each section is a frozen value. Each key is declared
once, in its field's metadata (type, bounds, default, help: ``service/settings/declarations.py``);
``__post_init__`` checks what spans keys and raises :class:`ValueError` naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from lookups.redact import redact_uri

__all__ = [
    "MongoSettings",
    "HttpSettings",
    "LookupSettings",
    "SHIPPED_OPTIONAL",
    "Resilience",
    "HttpOptions",
    "MongoOptions",
    "BEARER_TOKEN",
    "check_url",
]

# RFC 6750 b64token: what may follow "Bearer " in an Authorization header.
BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


@dataclass(frozen=True)
class Resilience:
    """What every backend's settings hold: its retry budget and circuit breaker."""

    retry_budget_ratio: float = field(
        default=0.2,
        metadata={
            "help": "retries at most this share of calls, plus 10 a second (see "
            "[Retries](../reference/limits.md#retries-circuit-breakers-and-hedged-requests)); "
            "`0`: no retries",
            "min": 0.0,
            "max": 1.0,
        },
    )
    breaker_failures: int = field(
        default=5, metadata={"help": "failures in a row that open the backend's circuit", "min": 1}
    )
    breaker_failure_rate: float = field(
        default=0.5,
        metadata={
            "help": "or more than this share of at least 20 calls in 10 s (above 0; `1.0`: never "
            "by rate)",
            "max": 1.0,
        },
    )
    breaker_open_ms: int = field(
        default=2000,
        metadata={"help": "how long a circuit stays open before one trial call", "min": 1},
    )

    def _check_resilience(self) -> None:
        if not self.breaker_failure_rate > 0.0:
            raise ValueError(
                f"breaker_failure_rate: must be in (0, 1], got {self.breaker_failure_rate}"
            )


@dataclass(frozen=True)
class HttpOptions:
    """What an HTTP backend's settings hold besides its URL and pool: timeouts, token, TLS."""

    connect_timeout_ms: int = field(
        default=250,
        metadata={
            "help": "TCP connect timeout (the task's deadline still caps it); short on purpose: a "
            "retry's fresh SYN beats the kernel's 1 s retransmission",
            "min": 1,
        },
    )
    read_timeout_ms: int = field(
        default=1000,
        metadata={
            "help": "per-read timeout (the task's deadline still caps it); a panel whose timeout "
            "is "
            "longer is warned at start-up: each attempt waits at most this long, the rest "
            "of its time goes to retries",
            "min": 1,
        },
    )
    auth_token: str = field(
        default="", metadata={"help": "sent as `Authorization: Bearer …`; never logged"}
    )
    ca_file: str = field(
        default="",
        metadata={
            "help": "HTTPS: trust the CAs in this PEM file instead of the system's (a private CA)"
        },
    )
    client_cert_file: str = field(
        default="",
        metadata={"help": "HTTPS services that ask for a client certificate get this one (PEM)"},
    )
    client_key_file: str = field(
        default="", metadata={"help": "the key of `client_cert_file`, if not in the same file"}
    )

    @property
    def authorization(self) -> str | None:
        """The ``Authorization`` header value for ``auth_token``, or ``None`` when unset."""
        return f"Bearer {self.auth_token}" if self.auth_token else None

    def _check_http_options(self) -> None:
        if self.auth_token and not BEARER_TOKEN.fullmatch(self.auth_token):
            # Never quoted: the value is a secret, and requests would quote it in its error.
            raise ValueError(
                "auth_token: must be a bearer token (letters, digits and "
                "-._~+/, optionally ending in =)"
            )
        if self.client_key_file and not self.client_cert_file:
            raise ValueError("client_key_file: needs client_cert_file")


def check_url(key: str, url: str, schemes: tuple[str, ...] = ("http", "https")) -> None:
    """Raise :class:`ValueError` naming ``key`` unless ``url`` is a URL of one of ``schemes``
    with a host (a ``unix`` one: a path) and a valid port. The message quotes the URL with
    its credentials redacted: a URL may carry a password (``redis://:secret@host``)."""
    shown = redact_uri(url)
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        wanted = " or ".join(f"{scheme}://" for scheme in schemes)
        raise ValueError(f"{key}: must start with {wanted}, got {shown!r}")
    try:
        parts.port  # noqa: B018 - reading it checks it: ValueError when not a port
    except ValueError:
        raise ValueError(f"{key}: not a valid port in {shown!r}") from None
    if not (parts.path if parts.scheme == "unix" else parts.hostname):
        raise ValueError(f"{key}: no {'path' if parts.scheme == 'unix' else 'host'} in {shown!r}")


@dataclass(frozen=True)
class MongoOptions:
    """What a MongoDB backend's settings hold besides its pool: where, which database, timeouts."""

    uri: str = field(
        default="mongodb://127.0.0.1:27017",
        metadata={"help": "MongoDB connection string (TLS and every pymongo option included)"},
    )
    database: str = field(default="apm", metadata={"help": "database holding the collections"})
    connect_timeout_ms: int = field(
        default=10_000,
        metadata={
            "help": "how long pymongo's monitor waits to connect and for each check's answer "
            "(pymongo's connectTimeoutMS, which it uses for both); calls never wait this long, "
            "their deadline bounds them. A check answered later marks the server unknown and "
            "fails every call in flight: keep it above the engine's slowest answer under load",
            "min": 1,
        },
    )
    server_selection_timeout_ms: int = field(
        default=1000,
        metadata={
            "help": "how long to look for a usable server (the task's deadline still caps it)",
            "min": 1,
        },
    )


@dataclass(frozen=True)
class MongoSettings(MongoOptions, Resilience):
    """``[mongo]``, the alias of ``[backends.mongo]``: where, which database, pool size,
    timeouts."""

    max_pool_size: int = field(
        default=32, metadata={"help": "MongoDB connection pool size", "min": 1}
    )

    def __post_init__(self) -> None:
        self._check_resilience()


@dataclass(frozen=True)
class HttpSettings(HttpOptions, Resilience):
    """``[http]``, the alias of ``[backends.alerts]`` and ``[backends.metrics]``: their base
    URLs, and the pool, timeouts, bearer token and TLS files both share."""

    alerts_url: str = field(
        default="http://127.0.0.1:8081", metadata={"help": "alerts service base URL"}
    )
    metrics_url: str = field(
        default="http://127.0.0.1:8082", metadata={"help": "metrics service base URL"}
    )
    pool_maxsize: int = field(
        default=32, metadata={"help": "HTTP connections kept per service", "min": 1}
    )

    def __post_init__(self) -> None:
        check_url("alerts_url", self.alerts_url)
        check_url("metrics_url", self.metrics_url)
        self._check_http_options()
        self._check_resilience()


#: The shipped dashboard's panels a user can live without for a minute: drill-downs and
#: context beside the errors, slow URLs, alerts and latency that say whether an app is
#: healthy now. Their ``optional`` is true unless a configuration says otherwise.
SHIPPED_OPTIONAL = frozenset({"controllers", "queries", "volume"})


@dataclass(frozen=True)
class LookupSettings:
    """Per-lookup policy, ``[lookups.<name>]``: the keys every panel has.

    A plugin's panel may add keys of its own (``lookups.plugins.with_settings``).
    """

    enabled: bool = field(
        default=True,
        metadata={"help": "`false`: the panel is not offered, and is `SKIPPED` when asked for"},
    )
    timeout_ms: int = field(
        default=0,
        metadata={"help": "this panel's timeout; `0` means `fanout.task_timeout_ms`", "min": 0},
    )
    optional: bool = field(
        default=False,
        metadata={
            "help": '`true`: under overload this panel is shed (`SKIPPED`, "Brownout") before '
            "any call is refused; the shipped dashboard's controllers, queries and volume "
            "are optional unless set `false`"
        },
    )
    required: bool = field(
        default=False,
        metadata={
            "help": "`true`: if this panel fails, its siblings are `CANCELLED` and the call raises "
            "`PanelFailed`"
        },
    )
    attempts: int = field(
        default=3,
        metadata={"help": "tries of one task, for failures safe to retry", "min": 1, "max": 10},
    )
    hedge: bool = field(
        default=False,
        metadata={
            "help": "send a second attempt after the backend's p95 latency; first answer wins"
        },
    )
    factory: str = field(
        default="",
        metadata={
            "help": "`module:attribute` of a lookup factory outside Fanout: a new panel (see "
            "[Adding a lookup](../how-to/add-a-lookup.md))"
        },
    )
