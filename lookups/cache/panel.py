"""What every cached panel is: a lookup with the panel's own lookup inside it."""

from __future__ import annotations

from lookups.base import Lookup

__all__ = ["CachedPanel"]


class CachedPanel(Lookup):
    """A panel answered from cached buckets; :attr:`inner`, the panel's own lookup, answers
    a call that asks for a fresh answer (``RequestMeta.fresh``)."""

    inner: Lookup
