"""Splitting a window into aligned time buckets and the uneven edges around them.

A bucket is ``[start, start + bucket_ms)`` with ``start`` a multiple of ``bucket_ms``
(epoch milliseconds, so buckets line up across windows, callers and instances). Of a
window ``[start_ms, end_ms)`` the cache keeps only the buckets that lie wholly inside it
and ended before ``settled_before_ms`` (now minus ``cache.settle_ms``): data can still
arrive for a newer one. What is left, at most one run at each end of the window, is
queried directly every time::

    start_ms                                             settled_before_ms   end_ms
       |  edge  |  bucket  |  bucket  |  ...  |  bucket  |      edge             |
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BucketPlan", "bucket_runs", "plan_buckets"]


@dataclass(frozen=True)
class BucketPlan:
    """What a window is made of: the starts of its cacheable buckets, and the
    ``[start, end)`` ranges around them that are queried directly (none, one or two)."""

    bucket_ms: int
    buckets: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]


def plan_buckets(start_ms: int, end_ms: int, bucket_ms: int, settled_before_ms: int) -> BucketPlan:
    """The plan for ``[start_ms, end_ms)``; a window too short or too recent for a whole
    settled bucket is one edge, the whole window (none when it is empty)."""
    if bucket_ms <= 0:
        raise ValueError(f"bucket_ms: must be positive, got {bucket_ms}")
    first = -(-start_ms // bucket_ms) * bucket_ms  # the first boundary at or after start
    last = (
        min(end_ms, settled_before_ms) // bucket_ms
    ) * bucket_ms  # the last one a bucket may end on
    if last - first < bucket_ms:
        only: tuple[tuple[int, int], ...] = ((start_ms, end_ms),) if start_ms < end_ms else ()
        return BucketPlan(bucket_ms, (), only)
    buckets = tuple(range(first, last, bucket_ms))
    edges = tuple((a, b) for a, b in ((start_ms, first), (last, end_ms)) if a < b)
    return BucketPlan(bucket_ms, buckets, edges)


def bucket_runs(starts: list[int], bucket_ms: int) -> list[tuple[int, int]]:
    """Buckets starting at ``starts`` (ascending) as ``[start, end)`` ranges, consecutive
    buckets joined."""
    runs: list[tuple[int, int]] = []
    for start in starts:
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + bucket_ms)
        else:
            runs.append((start, start + bucket_ms))
    return runs
