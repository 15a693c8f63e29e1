"""The MongoDB panels as sums of parts: each panel's groups over a time range, whole.

A part is every group of one range (``{key: [counts and sums]}``), small enough to
cache and exact to add: the part of ``[a, c)`` is the part of ``[a, b)`` plus the part
of ``[b, c)``, group by group. From the sum of a window's parts a panel ranks and limits
exactly as its one query over the window does (:mod:`lookups.mongo`), down to the
tie-break, by handing the lookup's own ``build`` the documents that query returns:

- errors: a count per message; the window's total is the sum of the counts, since every
  document falls in exactly one group;
- urls and controllers: per key the count, the sum of durations, and how many durations
  are numbers (``$avg`` divides by that, so the mean is the sum over it);
- queries: per raw statement the count and the sum of durations, from which the
  :data:`~lookups.mongo.QUERY_GROUP_CAP` largest are kept before shapes are merged.

A range whose groups are more than :data:`PART_GROUP_CAP`, or whose keys or sums are not
plain strings and numbers, has no part (:class:`NoPart`): its window is then answered by
the panel's own query, never approximated.

A short range (a window's uneven edges) can also be read as rows, each document's key and
summed field, and grouped here (:meth:`PanelParts.part_of_rows`) as ``$group`` would.
"""

from __future__ import annotations

import abc
import heapq
import json
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from bson.decimal128 import Decimal128
from bson.int64 import Int64

from lookups.mongo import (
    QUERY_GROUP_CAP,
    ErrorsLookup,
    MongoLookup,
    QueriesLookup,
    TopByCountLookup,
    ts_range,
)
from lookups.panels import TOP_N, PanelValue

__all__ = [
    "Part",
    "NoPart",
    "PART_GROUP_CAP",
    "PanelParts",
    "parts_of",
    "ranges_filter",
    "range_condition",
    "encode_part",
    "part_json_bytes",
    "decode_part",
    "add_parts",
    "subtract_part",
]

#: Groups per range kept whole; a range with more is answered by a direct query.
PART_GROUP_CAP = 2000

#: One range's groups: key (a string, or None where documents lack the field) to sums.
Part = dict[str | None, list[float]]

_NUMBERS = (int, Int64, float)


class NoPart(Exception):
    """A range's groups cannot be kept whole and exact (too many, or of other types)."""


def ranges_filter(app: str, ranges: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The ``$match`` document for ``app`` over the union of ``[start, end)`` ranges: for
    one range, :func:`lookups.mongo.window_filter`'s; for more, an ``$or`` of them."""
    if len(ranges) == 1:
        return {"$and": [{"app": app}, *ts_range(*ranges[0])]}
    return {"$and": [{"app": app}, {"$or": [range_condition(start, end) for start, end in ranges]}]}


def range_condition(start_ms: int, end_ms: int) -> dict[str, Any]:
    """``start_ms <= ts < end_ms`` as a query condition."""
    return {"$and": ts_range(start_ms, end_ms)}


def encode_part(part: Part) -> bytes:
    """``part`` as compact JSON: one row per group, the key and then its sums."""
    return json.dumps([[key, *sums] for key, sums in part.items()], separators=(",", ":")).encode()


#: What a group adds to a part's JSON form beside its key's characters, about: its
#: quotes, brackets and commas, and then each sum's digits.
_GROUP_JSON_BYTES = 8
_SUM_JSON_BYTES = 10


def part_json_bytes(part: Part, width: int) -> int:
    """About the length of ``encode_part(part)`` (``width`` sums a group), not encoding
    it: its keys' characters and a fixed size a group. What a kept sum is counted at: it
    holds many groups, and is kept anew at every bucket boundary."""
    return sum(map(len, filter(None, part))) + len(part) * (
        _GROUP_JSON_BYTES + _SUM_JSON_BYTES * width
    )


def decode_part(value: bytes) -> Part | None:
    """A part from :func:`encode_part`, or None when ``value`` is not one."""
    try:
        return {row[0]: row[1:] for row in json.loads(value)}
    except (ValueError, TypeError, IndexError, KeyError):
        return None


def add_parts(parts: Iterable[Part]) -> Part:
    """The part of the union of the parts' (disjoint) ranges; no part given is changed.

    The largest part is copied as it is (its lists shared, never written), and only the
    groups the others touch get new lists: a window's sum of buckets plus its small edges
    costs about the edges."""
    ordered = sorted(parts, key=len, reverse=True)
    total: Part = dict(ordered[0]) if ordered else {}
    for part in ordered[1:]:
        for key, sums in part.items():
            known = total.get(key)
            total[key] = list(sums) if known is None else [a + b for a, b in zip(known, sums)]
    return total


def subtract_part(total: Part, part: Part) -> Part:
    """``total`` without ``part``'s range, which it holds: a group left with no document
    (its count, the first sum of every panel, at 0) is gone, as from the query."""
    left = dict(total)
    for key, sums in part.items():
        known = left.get(key)
        if known is None:
            raise NoPart(f"a group {key!r} subtracted from a sum that lacks it")
        rest = [a - b for a, b in zip(known, sums)]
        if rest[0] == 0:
            del left[key]
        else:
            left[key] = rest
    return left


class PanelParts(abc.ABC):
    """How one panel's lookup is computed from parts: the stages that give a range's
    groups, reading them into a :data:`Part`, and the panel from a window's sum of parts."""

    #: The group fields after ``_id``, in the order a part's sums hold them.
    fields: ClassVar[tuple[str, ...]]

    def __init__(self, lookup: MongoLookup) -> None:
        self.lookup = lookup

    @property
    @abc.abstractmethod
    def key_field(self) -> str:
        """The documents' field the panel groups by."""

    @abc.abstractmethod
    def sums(self) -> dict[str, Any]:
        """The ``$group`` accumulators of :attr:`fields`, by name."""

    def stages(self) -> list[dict[str, Any]]:
        """The stages after the range's ``$match``: one document per group, ``_id`` and
        :attr:`fields`, at most ``PART_GROUP_CAP + 1`` of them."""
        return [
            {"$group": {"_id": f"${self.key_field}", **self.sums()}},
            {"$limit": PART_GROUP_CAP + 1},
        ]

    #: The documents' field the panel sums (durations), or None where it only counts.
    summed: ClassVar[str | None] = "duration_ms"

    def row_stages(self) -> list[dict[str, Any]]:
        """The stages after a range's ``$match`` that give one row per document, for
        :meth:`part_of_rows`: its key as ``k`` and its summed field as ``v`` (absent where
        the document lacks them)."""
        row = {"_id": 0, "k": f"${self.key_field}"}
        if self.summed is not None:
            row["v"] = f"${self.summed}"
        return [{"$project": row}]

    def part_of_rows(self, rows: Iterable[Any]) -> Part:
        """The range's groups from its :meth:`row_stages` rows, exactly as :meth:`stages`
        groups them on the server (``$sum`` skips what is not a number, ``$isNumber``
        counts what is); NoPart where :meth:`part` would have none."""
        part: Part = {}
        summing, timing = "total_ms" in self.fields, "timed" in self.fields
        for row in rows:
            key, value = row.get("k"), row.get("v")
            if not (key is None or type(key) is str) or type(value) is Decimal128:
                raise NoPart(f"{self.lookup.name}: a group of other types than strings and numbers")
            sums = part.get(key)
            if sums is None:
                if len(part) == PART_GROUP_CAP:
                    raise NoPart(
                        f"{self.lookup.name}: more than {PART_GROUP_CAP} groups in a range"
                    )
                sums = part[key] = [0] * len(self.fields)
            sums[0] += 1
            if type(value) in _NUMBERS:
                if summing:
                    sums[1] += value
                if timing:
                    sums[2] += 1
        return {
            key: [v if type(v) is float else int(v) for v in sums] for key, sums in part.items()
        }

    def stages_by(self, bucket: dict[str, Any]) -> list[dict[str, Any]]:
        """The groups of every bucket of a range: ``_id`` is ``{"b": bucket, "k": key}``."""
        return [{"$group": {"_id": {"b": bucket, "k": f"${self.key_field}"}, **self.sums()}}]

    @abc.abstractmethod
    def finish(self, total: Part, ranked: list[str | None] | None = None) -> PanelValue:
        """The panel value from the window's sum of parts (its :meth:`ranked_keys`, when
        already known)."""

    def part(self, documents: Sequence[Any]) -> Part:
        """The range's groups from the documents of :meth:`stages`; NoPart if not whole."""
        if len(documents) > PART_GROUP_CAP:
            raise NoPart(f"{self.lookup.name}: more than {PART_GROUP_CAP} groups in a range")
        part: Part = {}
        for group in documents:
            key = group.get("_id") if isinstance(group, dict) else None
            sums: list[Any] = (
                [group.get(name) for name in self.fields] if isinstance(group, dict) else []
            )
            if not (key is None or type(key) is str) or not all(type(v) in _NUMBERS for v in sums):
                raise NoPart(f"{self.lookup.name}: a group of other types than strings and numbers")
            part[key] = [v if type(v) is float else int(v) for v in sums]
        return part

    #: Which of :attr:`fields` the panel ranks by (descending, then by key), and how many
    #: groups it keeps: the query's ``{$sort: {field: -1, _id: 1}}, {$limit}``.
    rank_by: ClassVar[int] = 0
    limit: ClassVar[int] = TOP_N
    #: Whether :meth:`finish` reads only the ranked keys' sums (then a window's total
    #: need hold no other group); False where it sums every group.
    finish_reads_ranked_only: ClassVar[bool] = True

    def ranked_keys(
        self,
        total: Part,
        candidates: Iterable[str | None] | None = None,
    ) -> list[str | None]:
        """The :attr:`limit` first keys of ``total`` as the query ranks them (null before
        every string), looking only at ``candidates`` when given.

        Candidates are exact when they are the ranked keys of a part ``P`` plus every key
        of a part ``E`` whose sums are never negative, and ``total = P + E``: no other group
        of ``P`` can overtake them, since theirs only grew."""
        index = self.rank_by
        keys = total if candidates is None else set(candidates)
        # Each key's rank as a tuple, compared in C; the key itself, last, is never reached:
        # distinct keys differ before it. A few of many: a heap, not a sort of them all.
        rows = [(-total[k][index], k is not None, k or "", k) for k in keys]
        if self.limit * 4 < len(rows):
            return [row[3] for row in heapq.nsmallest(self.limit, rows)]
        rows.sort()
        return [row[3] for row in rows[: self.limit]]

    def _documents(self, total: Part, keys: Iterable[str | None]) -> list[dict[str, Any]]:
        return [{"_id": key, **dict(zip(self.fields, total[key]))} for key in keys]


class ErrorParts(PanelParts):
    fields = ("count",)
    key_field = "message"
    summed = None
    finish_reads_ranked_only = False  # the total count is every group's

    def sums(self) -> dict[str, Any]:
        return {"count": {"$sum": 1}}

    def finish(self, total: Part, ranked: list[str | None] | None = None) -> PanelValue:
        top = self._documents(total, self.ranked_keys(total) if ranked is None else ranked)
        facets = {
            "total": [{"n": sum(sums[0] for sums in total.values())}] if total else [],
            "top": top,
        }
        return self.lookup.build([facets])


class TopByCountParts(PanelParts):
    fields = ("count", "total_ms", "timed")

    @property
    def key_field(self) -> str:
        return self.lookup.field  # type: ignore[attr-defined, no-any-return]  # TopByCount only

    def sums(self) -> dict[str, Any]:
        return {
            "count": {"$sum": 1},
            "total_ms": {"$sum": "$duration_ms"},
            "timed": {"$sum": {"$cond": [{"$isNumber": "$duration_ms"}, 1, 0]}},
        }

    def finish(self, total: Part, ranked: list[str | None] | None = None) -> PanelValue:
        top = self._documents(total, self.ranked_keys(total) if ranked is None else ranked)
        for entry in top:  # $avg: the sum of the numeric durations over how many there are
            timed = entry.pop("timed")
            entry["mean_ms"] = entry["total_ms"] / timed if timed else None
        return self.lookup.build(top)


class QueryParts(PanelParts):
    fields = ("count", "total_ms")
    key_field = "query"
    rank_by, limit = 1, QUERY_GROUP_CAP

    def sums(self) -> dict[str, Any]:
        return {"count": {"$sum": 1}, "total_ms": {"$sum": "$duration_ms"}}

    def finish(self, total: Part, ranked: list[str | None] | None = None) -> PanelValue:
        keys = self.ranked_keys(total) if ranked is None else ranked
        return self.lookup.build(self._documents(total, keys))


def parts_of(lookup: Any) -> PanelParts | None:
    """How ``lookup`` is computed from parts, or None when it is not: HTTP lookups, plugins,
    and subclasses that change how the panel is queried or built."""
    for kind, parts in (
        (ErrorsLookup, ErrorParts),
        (TopByCountLookup, TopByCountParts),
        (QueriesLookup, QueryParts),
    ):
        cls = type(lookup)
        if isinstance(lookup, kind) and all(
            getattr(cls, method) is getattr(kind, method) for method in ("fetch", "stages", "build")
        ):
            return parts(lookup)
    return None
