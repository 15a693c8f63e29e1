"""Whose call a deadline serves: its place in every backend's line.

A call's :class:`~lookups.deadline.Deadline` carries its :class:`Flow` down to the
backends' slots (:class:`~lookups.backends.ordered_slots.OrderedSlots`), which serve the
waiting tasks by it: first by criticality, then fairly among callers by weight. The
service's gate sets it when it admits a call; work done for no call (a health check, a
cache plan's timing) has :data:`NO_FLOW` and waits as the most critical, with no caller.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Flow", "NO_FLOW"]


class Flow(NamedTuple):
    """A call's criticality's rank (lower first), its caller's name (empty: none) and weight."""

    rank: int = 0
    caller: str = ""
    weight: float = 1.0


#: No call's: the most critical, no caller.
NO_FLOW = Flow()
