"""What every cached panel is: a lookup with the panel's own lookup inside it, whose
fills are shared by the callers that need them at once."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from gevent.event import AsyncResult

from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout

__all__ = ["CachedPanel"]

T = TypeVar("T")


class CachedPanel(Lookup):
    """A panel answered from cached buckets; :attr:`inner`, the panel's own lookup, answers
    a call that asks for a fresh answer (``RequestMeta.fresh``)."""

    inner: Lookup

    def __init__(self) -> None:
        self._fills: dict[tuple[Any, ...], AsyncResult] = {}

    def _shared(self, key: tuple[Any, ...], deadline: Deadline, query: Callable[[], T]) -> T:
        """``query()``'s answer, asked once however many callers ask for ``key`` meanwhile."""
        pending = self._fills.get(key)
        if pending is not None:  # another caller is filling them: wait for it, within our deadline
            if pending.wait(deadline.remaining_s()) is None and not pending.ready():
                raise BackendTimeout(f"{self.name}: no time left waiting for a bucket fill",
                                     backend_fault=False)
            return pending.get()  # type: ignore[no-any-return]
        pending = self._fills[key] = AsyncResult()
        try:
            answer = query()
            pending.set(answer)
            return answer
        except BaseException as exc:
            pending.set_exception(exc if isinstance(exc, Exception) else
                                  BackendTimeout(f"{self.name}: the bucket fill was stopped",
                                                 backend_fault=False))
            raise
        finally:
            del self._fills[key]
