"""Querying missing buckets' parts: every bucket in one pass where the engine computes the
bucket, a ``$facet`` per bucket where it does not.

Grouped (:func:`fill_grouped`): one aggregation over the buckets' range groups by
``{b: the bucket's start, k: the panel's key}``, the bucket computed by the engine from
``ts`` (``$toLong``, ``$mod``: MongoDB, FerretDB 2). Its cost is about the panel's one
query over the same range, however many buckets it fills. An engine that does not
compute it (nx-27017 echoes the expression back) gets ``None``, and its buckets are
filled by :func:`fill_faceted`: one ``$facet`` per bucket, each filtering every document
of the query's range, so only a few buckets a call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bson.int64 import Int64

from lookups.errors import BadBackendResponse
from lookups.mongo_parts import (
    PART_GROUP_CAP,
    NoPart,
    PanelParts,
    Part,
    range_condition,
    ranges_filter,
)

__all__ = ["fill_grouped", "fill_faceted", "Aggregate"]

#: Runs an aggregation pipeline on the panel's collection, within the caller's deadline.
Aggregate = Callable[[list[dict[str, Any]]], list[Any]]


def fill_grouped(
    parts: PanelParts, aggregate: Aggregate, app: str, starts: Sequence[int], bucket_ms: int
) -> list[Part] | None:
    """The parts of the buckets starting at ``starts`` (ascending, not before 1970), or
    None when the engine does not compute buckets. NoPart when a bucket's groups are too many."""
    ts = {"$toLong": "$ts"}
    bucket = {"$subtract": [ts, {"$mod": [ts, bucket_ms]}]}
    limit = (PART_GROUP_CAP + 1) * len(starts)
    pipeline = [
        {"$match": ranges_filter(app, [(starts[0], starts[-1] + bucket_ms)])},
        *parts.stages_by(bucket),
        {"$limit": limit},
    ]
    documents = aggregate(pipeline)
    wanted: dict[int, list[dict[str, Any]]] = {
        start: [] for start in range(starts[0], starts[-1] + bucket_ms, bucket_ms)
    }
    for document in documents:
        key = document.get("_id") if isinstance(document, dict) else None
        if not isinstance(key, dict):
            return None
        start = key.get("b")
        if type(start) not in (int, Int64) or start not in wanted:
            return None
        wanted[start].append({**document, "_id": key.get("k")})
    if len(documents) >= limit:
        raise NoPart(f"{parts.lookup.name}: more than {PART_GROUP_CAP} groups in a bucket")
    return [parts.part(wanted[start]) for start in starts]


def fill_faceted(
    parts: PanelParts, aggregate: Aggregate, app: str, starts: Sequence[int], bucket_ms: int
) -> list[Part]:
    """The parts of the buckets starting at ``starts`` (ascending), a ``$facet`` each."""
    facets = {
        f"b{start}": [{"$match": range_condition(start, start + bucket_ms)}, *parts.stages()]
        for start in starts
    }
    pipeline = [
        {"$match": ranges_filter(app, [(starts[0], starts[-1] + bucket_ms)])},
        {"$facet": facets},
    ]
    documents = aggregate(pipeline)
    reply = documents[0] if len(documents) == 1 and isinstance(documents[0], dict) else {}
    if not all(isinstance(reply.get(f"b{start}"), list) for start in starts):
        raise BadBackendResponse(f"{parts.lookup.name}: a bucket fill's reply lacks its buckets")
    return [parts.part(reply[f"b{start}"]) for start in starts]
