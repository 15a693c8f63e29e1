"""The ``[cache]`` settings section: the results cache of MongoDB panels' buckets.

Each key is declared once, in its field's metadata (type, bounds, default, help), as
``service/settings/declarations.py`` describes; ``__post_init__`` checks what spans keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lookups.settings import check_url

__all__ = ["CacheSettings"]


@dataclass(frozen=True)
class CacheSettings:
    """The results cache: which buckets are kept, for how long, and where."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "`true`: the MongoDB panels and the alerts are merged from cached buckets "
            "and a query for the window's edges (see "
            "[Results cache](../explanation/results-cache.md))"
        },
    )
    bucket_ms: int = field(
        default=900_000,
        metadata={
            "help": "the buckets' length, aligned to the epoch: a refresh queries at most about "
            "one bucket plus `settle_ms` of documents",
            "min": 1000,
        },
    )
    settle_ms: int = field(
        default=120_000,
        metadata={
            "help": "a bucket is cached only once it ended this long ago: documents may arrive "
            "this late",
            "min": 0,
        },
    )
    max_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata={
            "help": "the in-process cache's bound: keys and values, least recently used out first",
            "min": 0,
        },
    )
    url: str = field(
        default="",
        metadata={
            "help": "`redis://host:port/db` (or `rediss://`): buckets shared by every instance "
            "in Redis, through redis-py; empty: in this process only"
        },
    )
    redis_timeout_ms: int = field(
        default=50,
        metadata={
            "help": "each Redis command's timeout; a slow or absent Redis counts as misses",
            "min": 1,
        },
    )
    ttl_s: int = field(
        default=172_800,
        metadata={
            "help": "how long Redis keeps a bucket (the in-process cache keeps it until evicted)",
            "min": 1,
        },
    )

    plan: str = field(
        default="measured",
        metadata={
            "help": "how a MongoDB panel's window is answered: `measured`, by the panel's own "
            "query until timings of both plans, each alone on the engine, find the buckets "
            "cheaper there; `buckets`, always from the cached buckets, probing nothing (see "
            "[Results cache](../explanation/results-cache.md))",
            "choices": ("buckets", "measured"),
        },
    )
    replan_ms: int = field(
        default=60_000,
        metadata={
            "help": 'with `plan = "measured"`, how often one window runs both plans again, '
            "each alone on the engine, to time them; the period doubles, up to 8 times, "
            "while the timings agree, and is at least as many times this as the dearer plan "
            "cost the cheaper (up to 8)",
            "min": 100,
        },
    )

    def __post_init__(self) -> None:
        if self.url:
            check_url("url", self.url, ("redis", "rediss", "unix"))
