"""How many connections each worker should give up so that the group's work spreads again.

A connection stays with the worker that accepted it for as long as its caller
keeps it open, and a web tier's Thrift pool keeps it open for hours. After a
worker is replaced, every connection sits on the survivors and the new worker
serves nothing until callers reconnect, which pooled callers never do. So the
master moves connections from the fullest workers to the emptiest
(:mod:`service.listener.handover`), between calls, with none lost.

It acts only on a clear imbalance, so that it does not shuffle connections back
and forth as callers come and go: when the fullest worker holds at least
:data:`MIN_GAP` more than the emptiest and more than :data:`TOLERANCE` times the
mean. It then asks each worker above the mean (rounded up) for its excess.
"""

from __future__ import annotations

import math

__all__ = ["excess", "MIN_GAP", "TOLERANCE"]

MIN_GAP = 2
TOLERANCE = 1.2


def excess(connections: dict[int, int]) -> dict[int, int]:
    """For each worker (by pid) that should give connections up, how many."""
    if len(connections) < 2:
        return {}
    mean = sum(connections.values()) / len(connections)
    fullest, emptiest = max(connections.values()), min(connections.values())
    if fullest - emptiest < MIN_GAP or fullest <= TOLERANCE * mean:
        return {}
    share = math.ceil(mean)
    return {pid: count - share for pid, count in connections.items() if count > share}
