"""What every cached panel is: a lookup with the panel's own lookup inside it, over a
store of aligned buckets, whose fills are shared by the callers that need them at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gevent.event import AsyncResult
from opentelemetry import trace

from lookups.base import Lookup
from lookups.cache.settings import CacheSettings
from lookups.cache.stores import BucketStore
from lookups.clock import Clock
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout

__all__ = ["CachedPanel"]

T = TypeVar("T")


class CachedPanel(Lookup):
    """A panel answered from cached buckets; :attr:`inner`, the panel's own lookup, answers
    a call that asks for a fresh answer (``RequestMeta.fresh``)."""

    def __init__(
        self,
        inner: Lookup,
        store: BucketStore,
        settings: CacheSettings,
        prefix: str,
        clock: Clock,
    ) -> None:
        """``prefix`` starts every key of this panel's buckets; ``clock`` is the service's,
        read for dates."""
        self.inner, self.store = inner, store
        self.name, self.source = inner.name, inner.source  # type: ignore[misc]  # ClassVars of the class, copied per instance
        self._bucket_ms, self._settle_ms = settings.bucket_ms, settings.settle_ms
        self._prefix, self._clock = prefix, clock
        self._fills: dict[tuple[Any, ...], AsyncResult] = {}

    def key(self, app: str, start_ms: int) -> str:
        """The store's key of ``app``'s bucket starting at ``start_ms``."""
        return f"{self._prefix}:{start_ms}:{app}"

    def _settled_before_ms(self) -> int:
        """Buckets that end before this instant may be cached: ``settle_ms`` ago."""
        return int(self._clock.wall() * 1000) - self._settle_ms

    def _counted(self, cached: int, queried: int) -> None:
        """Count buckets read and missing, on the store's counters and the task's span."""
        self.store.stats.hits += cached
        self.store.stats.misses += queried
        span = trace.get_current_span()
        span.set_attribute("fanout.cache.buckets_cached", cached)
        span.set_attribute("fanout.cache.buckets_queried", queried)

    def _shared(self, key: tuple[Any, ...], deadline: Deadline, query: Callable[[], T]) -> T:
        """``query()``'s answer, asked once however many callers ask for ``key`` meanwhile."""
        pending = self._fills.get(key)
        if pending is not None:  # another caller is filling them: wait for it, within our deadline
            if not deadline.clock.join(pending, deadline.at):
                raise BackendTimeout(
                    f"{self.name}: no time left waiting for a bucket fill", backend_fault=False
                )
            value: T = pending.get()  # gevent is untyped: the fill's own result type
            return value
        pending = self._fills[key] = AsyncResult()
        try:
            answer = query()
            pending.set(answer)
            return answer
        except BaseException as exc:
            pending.set_exception(
                exc
                if isinstance(exc, Exception)
                else BackendTimeout(
                    f"{self.name}: the bucket fill was stopped", backend_fault=False
                )
            )
            raise
        finally:
            del self._fills[key]
