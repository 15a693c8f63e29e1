"""The sums of whole runs of buckets, kept decoded, so that a refresh adds two parts, not 96.

A window's settled buckets stay the same from one refresh to the next until a bucket
boundary passes (every ``cache.bucket_ms``), and a settled bucket never changes. So
once every bucket of a run has been read or filled, their sum is kept here, keyed by the
panel, the app and the run's first and last bucket, and the next refresh of the same
window reads neither the store nor any JSON. Bounded in bytes (each entry counts the
length of its JSON form), least recently used out first.
"""

from __future__ import annotations

import collections
import json
from typing import Hashable, Optional

from lookups.mongo_parts import Part

__all__ = ["MergedRuns"]


class MergedRuns:
    """Sums of runs of buckets by key, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[Hashable, tuple[Part, int]] = collections.OrderedDict()

    def get(self, key: Hashable) -> Optional[Part]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, merged: Part) -> None:
        size = len(json.dumps([[k, *sums] for k, sums in merged.items()], separators=(",", ":")))
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (merged, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)
