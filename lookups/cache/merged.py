"""The sums of whole runs of buckets, kept decoded, so that a refresh adds two parts, not 96.

A window's settled buckets stay the same from one refresh to the next until a bucket
boundary passes (every ``cache.bucket_ms``), and a settled bucket never changes. So
once every bucket of a run has been read or filled, their sum is kept here, keyed by the
panel, the app and the run's first and last bucket, with its groups ranked as the panel
ranks them; the next refresh of the same window reads neither the store nor any JSON,
and ranks only those groups and the ones its edges touched
(:meth:`~lookups.mongo_parts.PanelParts.ranked_keys` says why that is exact). Bounded in
bytes (each entry counts the length of its JSON form), least recently used out first.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from typing import Hashable, Optional

from lookups.cache.stores import CacheStats
from lookups.mongo_parts import PanelParts, Part

__all__ = ["MergedRun", "MergedRuns"]


@dataclass(frozen=True)
class MergedRun:
    """The sum of a run of buckets, and its keys as its panel ranks them."""

    total: Part
    ranked: list[Optional[str]]
    parts: PanelParts

    def ranked_with(self, total: Part, added: Part) -> Optional[list[Optional[str]]]:
        """The ranked keys of ``total`` (this run plus ``added``), or None when ``added``
        subtracts from the ranking field somewhere (then the whole sum is ranked)."""
        index = self.parts.rank_by
        if any(sums[index] < 0 for sums in added.values()):
            return None
        return self.parts.ranked_keys(total, [*self.ranked, *added])


class MergedRuns:
    """Sums of runs of buckets by key, within ``max_bytes``; what they hold is counted in
    ``stats.bytes`` too, beside the store's buckets."""

    def __init__(self, max_bytes: int, stats: Optional[CacheStats] = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._stats = stats or CacheStats()
        self._entries: collections.OrderedDict[Hashable, tuple[MergedRun, int]] = \
            collections.OrderedDict()

    def get(self, key: Hashable) -> Optional[MergedRun]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, total: Part, parts: PanelParts) -> MergedRun:
        """Keep ``total`` (ranked by ``parts``) under ``key``, if it fits; the kept run."""
        merged = MergedRun(total, parts.ranked_keys(total), parts)
        size = len(json.dumps([[k, *sums] for k, sums in total.items()], separators=(",", ":")))
        if size > self.max_bytes:
            return merged
        old = self._entries.pop(key, None)
        if old is not None:
            self._count(-old[1])
        self._entries[key] = (merged, size)
        self._count(size)
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._count(-dropped)
        return merged

    def _count(self, size: int) -> None:
        self.bytes += size
        self._stats.bytes += size

    def __len__(self) -> int:
        return len(self._entries)
