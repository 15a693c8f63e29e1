"""Every backend of a process, built from ``[backends.<name>]`` (and the aliases).

A lookup names its backend (``Lookup.backend``) and its factory takes it from here::

    registry.register("slow_jobs", lambda backends: SlowJobsLookup(backends.http("slow_jobs")))

Health checks, ``pool_stats``, ``fanout pools`` and the metrics iterate over the same
backends, so a plugin's backend gets a health check and a pool report without an edit
to Fanout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TypeVar

from lookups.backends.base import Backend
from lookups.backends.http import HttpBackend
from lookups.backends.mongo import MongoBackend
from lookups.backends.settings import BackendSettings, HttpBackendSettings
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.redact import redact_uri
from lookups.resilience import RetryPolicy
from lookups.settings import LookupSettings

_B = TypeVar("_B", bound=Backend)

__all__ = ["Backends"]

log = logging.getLogger(__name__)


class Backends:
    """The backends by name, in configuration order; a context manager that closes them.

    Raises :class:`ValueError` naming the key when a backend's settings cannot be used
    (an invalid MongoDB URI, a TLS file that does not load): ``backends.<name>.<key>``,
    or where ``sections`` says the backend's keys were written (``{"alerts": "http"}``).
    """

    def __init__(
        self,
        settings: Mapping[str, BackendSettings],
        lookups: Mapping[str, LookupSettings] = MappingProxyType({}),
        sections: Mapping[str, str] = MappingProxyType({}),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        policies = {name: RetryPolicy(p.attempts, p.hedge) for name, p in lookups.items()}
        self._backends: dict[str, Backend] = {}
        try:
            for name, backend_settings in settings.items():
                kind = (
                    HttpBackend
                    if isinstance(backend_settings, HttpBackendSettings)
                    else MongoBackend
                )
                try:
                    self._backends[name] = kind(name, backend_settings, policies, clock=clock)  # type: ignore[arg-type]  # matched above
                except ValueError as exc:
                    raise ValueError(f"{sections.get(name, f'backends.{name}')}.{exc}") from None
        except Exception:
            self.close()
            raise
        log.debug(
            "backends: %s",
            ", ".join(
                f"{name} ({backend.kind} {redact_uri(_address(backend.settings))})"
                for name, backend in self._backends.items()
            ),
        )

    def __getitem__(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise KeyError(
                f"no backend {name!r}; configured: {', '.join(self._backends)} "
                f"(add a [backends.{name}] table)"
            ) from None

    def mongo(self, name: str = "mongo") -> MongoBackend:
        """Backend ``name``, which must be a MongoDB one; ``KeyError`` saying why otherwise."""
        return self._of_kind(name, MongoBackend)

    def http(self, name: str) -> HttpBackend:
        """Backend ``name``, which must be an HTTP one; ``KeyError`` saying why otherwise."""
        return self._of_kind(name, HttpBackend)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def connections_in_use(self) -> dict[str, int]:
        """Connections checked out of each backend's library pool right now, by name."""
        return {name: backend.connections_in_use() for name, backend in self._backends.items()}

    def close(self) -> None:
        """Close every backend's clients; idempotent."""
        for backend in self._backends.values():
            backend.close()

    def __enter__(self) -> Backends:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _of_kind(self, name: str, kind: type[_B]) -> _B:
        backend = self[name]
        if not isinstance(backend, kind):
            raise KeyError(f"backend {name!r} is {backend.kind}, not {kind.kind}")
        return backend


def _address(settings: BackendSettings) -> str:
    """Where a backend is: a MongoDB backend's ``uri``, an HTTP backend's ``url``."""
    return settings.url if isinstance(settings, HttpBackendSettings) else settings.uri
