"""Which configurations of a run make which series of a plot (no plotting here)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TRACING_MODES", "only", "tracing_series"]

Summaries = dict[str, dict[str, Any]]
_ROUND = re.compile(r"-r(\d+)$")  # a configuration of an interleaved round: tracing-off-r2


def only(summaries: Summaries, prefix: str) -> str:
    """The one configuration key starting with ``prefix`` (its connection count varies)."""
    return next((key for key in summaries if key.startswith(prefix)), prefix)


TRACING_MODES = (
    ("off", "off"),
    ("ratio1", "1% parent-based"),
    ("ratio10", "10% parent-based"),
    ("full", "100% + batch"),
)


def tracing_series(summaries: Summaries) -> dict[str, list[str]]:
    """The tracing scenario's keys by mode: one series per interleaved round
    (configurations named ``tracing-off-r1``), or one series when it ran without rounds."""
    names = [key.split("/")[1] for key in summaries if key.startswith("tracing/")]
    rounds = sorted({m.group(1) for n in names if (m := _ROUND.search(n))}, key=int)
    if not rounds:
        return {"fanout": [only(summaries, f"tracing/tracing-{m}/") for m, _ in TRACING_MODES]}
    return {
        f"round {n}": [only(summaries, f"tracing/tracing-{m}-r{n}/") for m, _ in TRACING_MODES]
        for n in rounds
    }
