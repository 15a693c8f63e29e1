"""The lookups' settings sections: ``[lookups.<name>]``, and the older ``[mongo]`` and
``[http]``, kept as aliases of ``[backends.mongo]``, ``[backends.alerts]`` and
``[backends.metrics]`` for one release (:mod:`lookups.backends.settings`).

Each section is a frozen value that can only be made valid: ``__post_init__``
raises :class:`ValueError` naming the key. ``CHOICES`` and ``INT_BOUNDS`` are the
per-key rules the loader (``service/config.py``) applies while coercing; an
integer key not in ``INT_BOUNDS`` must be at least 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

__all__ = ["MongoSettings", "HttpSettings", "LookupSettings", "Resilience", "HttpOptions",
           "BEARER_TOKEN", "check_url"]

# RFC 6750 b64token: what may follow "Bearer " in an Authorization header.
BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")

_NO_RULES: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class Resilience:
    """What every backend's settings hold: its retry budget and circuit breaker."""

    retry_budget_ratio: float = 0.2    # retries at most this share of calls (plus 10/s and a reserve)
    breaker_failures: int = 5          # consecutive failures that open the circuit
    breaker_failure_rate: float = 0.5  # ...or more than this share of at least 20 calls in 10 s
    breaker_open_ms: int = 2000        # how long it stays open before a probe

    def _check_resilience(self) -> None:
        if not 0.0 <= self.retry_budget_ratio <= 1.0:
            raise ValueError(f"retry_budget_ratio: must be within 0..1, got {self.retry_budget_ratio}")
        if not 0.0 < self.breaker_failure_rate <= 1.0:
            raise ValueError(f"breaker_failure_rate: must be in (0, 1], got {self.breaker_failure_rate}")


@dataclass(frozen=True)
class HttpOptions:
    """What an HTTP backend's settings hold besides its URL and pool: timeouts, token, TLS."""

    connect_timeout_ms: int = 250      # short: a retry sends a fresh SYN sooner than the kernel's 1 s
    read_timeout_ms: int = 1000
    auth_token: str = ""               # sent as "Authorization: Bearer ..."; never logged
    ca_file: str = ""                  # HTTPS: trust these CAs (PEM) instead of the system's
    client_cert_file: str = ""         # HTTPS: present this client certificate (PEM)...
    client_key_file: str = ""          # ...with this key, if not in the same file

    @property
    def authorization(self) -> Optional[str]:
        """The ``Authorization`` header value for ``auth_token``, or ``None`` when unset."""
        return f"Bearer {self.auth_token}" if self.auth_token else None

    def _check_http_options(self) -> None:
        if self.auth_token and not BEARER_TOKEN.fullmatch(self.auth_token):
            # Never quoted: the value is a secret, and requests would quote it in its error.
            raise ValueError("auth_token: must be a bearer token (letters, digits and "
                             "-._~+/, optionally ending in =)")
        if self.client_key_file and not self.client_cert_file:
            raise ValueError("client_key_file: needs client_cert_file")


def check_url(key: str, url: str) -> None:
    """Raise :class:`ValueError` naming ``key`` unless ``url`` is an http(s) URL."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{key}: must be an http:// or https:// URL, got {url!r}")


@dataclass(frozen=True)
class MongoSettings(Resilience):
    """``[mongo]``, the alias of ``[backends.mongo]``: where, which database, pool size, timeouts."""

    uri: str = "mongodb://127.0.0.1:27017"
    database: str = "apm"
    max_pool_size: int = 32
    connect_timeout_ms: int = 1000
    server_selection_timeout_ms: int = 1000

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = _NO_RULES
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = _NO_RULES

    def __post_init__(self) -> None:
        self._check_resilience()


@dataclass(frozen=True)
class HttpSettings(HttpOptions, Resilience):
    """``[http]``, the alias of ``[backends.alerts]`` and ``[backends.metrics]``: their base
    URLs, and the pool, timeouts, bearer token and TLS files both share."""

    alerts_url: str = "http://127.0.0.1:8081"
    metrics_url: str = "http://127.0.0.1:8082"
    pool_maxsize: int = 32

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = _NO_RULES
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = _NO_RULES

    def __post_init__(self) -> None:
        check_url("alerts_url", self.alerts_url)
        check_url("metrics_url", self.metrics_url)
        self._check_http_options()
        self._check_resilience()


@dataclass(frozen=True)
class LookupSettings:
    """Per-lookup policy. ``timeout_ms`` of 0 means ``fanout.task_timeout_ms``.

    ``attempts`` bounds the tries of one task (retries of safe failures only, within
    its budget); ``hedge`` sends a second attempt after the backend's p95 latency.
    """

    enabled: bool = True
    timeout_ms: int = 0
    required: bool = False
    attempts: int = 3
    hedge: bool = False
    factory: str = ""   # "module:attribute": a lookup from outside this package (lookups.plugins)

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = _NO_RULES
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"timeout_ms": (0, None), "attempts": (1, 10)})
