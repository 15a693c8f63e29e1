"""Where cached buckets live: in this process (:class:`MemoryStore`), or in Redis shared
by every instance (:class:`RedisStore`).

A store maps keys to bytes and never fails a call: a store that cannot answer answers
"nothing found" and counts the error. Both count into a :class:`CacheStats`, which the
metrics and ``fanout pools`` read.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from lookups.clock import SYSTEM_CLOCK, Clock

__all__ = ["CacheStats", "BucketStore", "SizedLRU", "MemoryStore", "RedisStore"]

V = TypeVar("V")

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    """Counters since start: buckets found and missed, filled by a query, evicted; windows
    answered by the panel's own query instead (too many groups, or the store down, or
    measured cheaper); the measured plan's timings; Redis errors; bytes held."""

    hits: int = 0
    misses: int = 0
    fills: int = 0
    evictions: int = 0
    direct: int = 0
    #: Windows the panel's own query answered, because it measured cheaper here than the
    #: buckets (``cache.plan = "measured"``, :mod:`lookups.cache.plans`; its timings,
    #: run for no caller, are not counted).
    query_windows: int = 0
    #: Timings of both plans (:mod:`lookups.cache.plans`): started; ended with a plan failed
    #: (no ratio); timed under load, the engine never found alone; running now.
    timings: int = 0
    timings_failed: int = 0
    timings_crowded: int = 0
    timings_running: int = 0
    redis_errors: int = 0
    bytes: int = 0
    #: Whether the store answered its last command: 1, or 0 from a failure to the next
    #: success (always 1 in process).
    store_up: int = 1


class BucketStore(Protocol):
    stats: CacheStats

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The values found of ``keys``; a key not found (or unreadable) is left out."""

    def put_many(self, items: Mapping[str, bytes]) -> None:
        """Keep ``items``; best effort."""

    def available(self) -> bool:
        """False while the store is known not to answer (then nothing is filled)."""

    def close(self) -> None:
        """Let go of what the store holds outside this process (its connections)."""


class SizedLRU(Generic[V]):
    """Values by key within ``max_bytes`` of the sizes they are put with, the least
    recently used out first. What it holds is added to ``stats.bytes`` (several share one
    :class:`CacheStats`); what it drops, to ``stats.evictions`` when ``evictions``."""

    def __init__(self, max_bytes: int, stats: CacheStats, evictions: bool) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._stats, self._evictions = stats, evictions
        self._entries: collections.OrderedDict[Hashable, tuple[V, int]] = collections.OrderedDict()

    def get(self, key: Hashable) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: V, size: int) -> None:
        """Keep ``value``, unless it is larger than the whole bound."""
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._count(-old[1])
        self._entries[key] = (value, size)
        self._count(size)
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._count(-dropped)
            self._stats.evictions += self._evictions

    def discard(self, key: Hashable) -> None:
        """Drop ``key``'s entry, if any (not counted as an eviction)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._count(-old[1])

    def clear(self) -> None:
        """Drop every entry (not counted as evictions)."""
        self._entries.clear()
        self._count(-self.bytes)

    def _count(self, size: int) -> None:
        self.bytes += size
        self._stats.bytes += size

    def __len__(self) -> int:
        return len(self._entries)


class MemoryStore:
    """Buckets in this process: a :class:`SizedLRU` where each counts its key's and its
    value's length."""

    def __init__(self, max_bytes: int, stats: CacheStats | None = None) -> None:
        self.stats = stats or CacheStats()
        self._lru: SizedLRU[bytes] = SizedLRU(max_bytes, self.stats, evictions=True)

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        found = {key: self._lru.get(key) for key in keys}
        return {key: value for key, value in found.items() if value is not None}

    def put_many(self, items: Mapping[str, bytes]) -> None:
        for key, value in items.items():
            self._lru.put(key, value, len(key) + len(value))

    def available(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def clear(self) -> None:
        """Drop every bucket (not counted as evictions)."""
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)


class RedisStore:
    """Buckets in Redis, each command bounded by ``timeout_ms``.

    After an error the store answers "nothing found" for ``pause_s`` without trying
    Redis, so a Redis that is down costs one timeout per pause, not one per call. An
    outage, from the first failed command to the next that succeeds, logs one line as it
    begins and one as it ends, however long it lasts and whatever fails in between.
    """

    def __init__(
        self,
        url: str,
        timeout_ms: int,
        ttl_s: int,
        stats: CacheStats | None = None,
        pause_s: float = 1.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        import redis  # only where a Redis is configured: it adds to every process's start

        self._errors: tuple[type[Exception], ...] = (redis.RedisError,)
        timeout_s = timeout_ms / 1000
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self._ttl_s = ttl_s
        self._pause_s = pause_s
        self._clock = clock
        self._paused_until = 0.0
        self._down_since: float | None = None
        self._failures = 0  # in the outage going on
        self.stats = stats or CacheStats()

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        if not keys or not self.available():
            return {}
        try:
            values = self._client.mget(keys)
        except self._errors as exc:
            self._failed("read", exc)
            return {}
        self._answered()
        return {key: value for key, value in zip(keys, values) if value is not None}

    def put_many(self, items: Mapping[str, bytes]) -> None:
        if not items or not self.available():
            return
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for key, value in items.items():
                    pipe.set(key, value, ex=self._ttl_s)
                pipe.execute()
        except self._errors as exc:
            self._failed("write", exc)
            return
        self._answered()

    def available(self) -> bool:
        return self._clock.monotonic() >= self._paused_until

    def close(self) -> None:
        self._client.close()

    def _failed(self, what: str, exc: Exception) -> None:
        self.stats.redis_errors += 1
        now = self._clock.monotonic()
        self._failures += 1
        if self._down_since is None:  # the outage's one line as it begins
            self._down_since = now
            self.stats.store_up = 0
            log.warning(
                "cache: Redis down: a %s failed (%s); panels are queried until it answers",
                what,
                type(exc).__name__,
            )
        self._paused_until = now + self._pause_s

    def _answered(self) -> None:
        if self._down_since is None:
            return
        down_s = self._clock.monotonic() - self._down_since
        log.warning(
            "cache: Redis answers again after %.1f s down (%d commands failed)",
            down_s,
            self._failures,
        )
        self._down_since, self._failures, self.stats.store_up = None, 0, 1
