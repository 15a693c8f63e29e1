"""The sums of whole runs of buckets, kept decoded, so that a refresh adds two parts, not 96.

A window's settled buckets stay the same from one refresh to the next until a bucket
boundary passes (every ``cache.bucket_ms``), and a settled bucket never changes. So
once every bucket of a run has been read or filled, their sum is kept here, keyed by the
panel, the app and the run's first and last bucket, with its groups ranked as the panel
ranks them; the next refresh of the same window reads neither the store nor any JSON,
and ranks only those groups and the ones its edges touched
(:meth:`~lookups.mongo_parts.PanelParts.ranked_keys` says why that is exact). Bounded in
bytes (each entry counts about the length of its JSON form), least recently used out first.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from lookups.cache.stores import CacheStats, SizedLRU
from lookups.mongo_parts import PanelParts, Part, part_json_bytes

__all__ = ["MergedRun", "MergedRuns"]


@dataclass(frozen=True)
class MergedRun:
    """The sum of a run of buckets, and its keys as its panel ranks them."""

    total: Part
    ranked: list[str | None]
    parts: PanelParts

    def ranked_with(self, total: Part, added: Part) -> list[str | None] | None:
        """The ranked keys of ``total`` (this run plus ``added``), or None when ``added``
        subtracts from the ranking field somewhere (then the whole sum is ranked)."""
        index = self.parts.rank_by
        if any(sums[index] < 0 for sums in added.values()):
            return None
        return self.parts.ranked_keys(total, [*self.ranked, *added])

    def top_with(self, added: Part) -> Part | None:
        """This run plus ``added``, for the groups that can rank only: this run's ranked
        keys and ``added``'s (exact by the argument of
        :meth:`~lookups.mongo_parts.PanelParts.ranked_keys`); the rest of this run's groups
        are not copied. None when ``added`` subtracts from the ranking field somewhere."""
        index = self.parts.rank_by
        if any(sums[index] < 0 for sums in added.values()):
            return None
        total = self.total
        top = {key: total[key] for key in self.ranked}
        # Not add_parts on the ranked groups alone: an added group outside them adds to its
        # sum in the whole run.
        for key, sums in added.items():
            known = total.get(key)
            top[key] = list(sums) if known is None else [a + b for a, b in zip(known, sums)]
        return top


class MergedRuns:
    """Sums of runs of buckets by key, within ``max_bytes`` (a :class:`SizedLRU`, each sum
    counted at about the length of its JSON form); what they hold is counted in ``stats.bytes``
    too, beside the store's buckets."""

    def __init__(self, max_bytes: int, stats: CacheStats | None = None) -> None:
        self._lru: SizedLRU[MergedRun] = SizedLRU(max_bytes, stats or CacheStats(), evictions=False)

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def get(self, key: Hashable) -> MergedRun | None:
        return self._lru.get(key)

    def put(
        self, key: Hashable, total: Part, parts: PanelParts, ranked: list[str | None] | None = None
    ) -> MergedRun:
        """Keep ``total`` under ``key``, if it fits; the kept run. ``ranked``: its keys as
        ``parts`` ranks them, when already known (else ranked here)."""
        merged = MergedRun(total, parts.ranked_keys(total) if ranked is None else ranked, parts)
        self._lru.put(key, merged, part_json_bytes(total, len(parts.fields)))
        return merged

    def discard(self, key: Hashable) -> None:
        """Drop the sum kept under ``key``, if any: a window moved on from it."""
        self._lru.discard(key)

    def __len__(self) -> int:
        return len(self._lru)
