"""What makes a captured call worth keeping (:mod:`tracing.capture`): its outcome, its
duration against its method's recent ones, the head sampler; and the ceiling on kept calls.

A reason is pure: :func:`keep_reason` reads the call's ended spans and its root, and says
the first reason that applies (``panel``, ``shed``, ``cut``, ``error``, ``slow``,
``sampled``) or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from opentelemetry.trace import StatusCode

from lookups.clock import SYSTEM_CLOCK, Clock

__all__ = ["KeepRules", "RecentQuantile", "KeptPerSecond", "keep_reason"]

#: A task's ``fanout.task.status`` that makes its call worth keeping, and why.
_TASK_REASONS = {"ERROR": "panel", "TIMEOUT": "cut", "CANCELLED": "cut"}
#: Why a task not run (``fanout.task.skip_reason``) makes its call worth keeping.
_SKIP_REASONS = {"brownout": "shed"}


class _Recorded(Protocol):
    """What :func:`keep_reason` reads of a span (:class:`tracing.capture.CapturedSpan`)."""

    name: str
    attributes: dict[str, Any]
    start_time: int
    end_time: int | None

    @property
    def status(self) -> Any: ...


class RecentQuantile:
    """The ``quantile`` of the last :attr:`WINDOW` durations of one method, worked out again
    every :attr:`EVERY` of them; None until :attr:`LEAST` have been seen."""

    WINDOW = 512
    EVERY = 64
    LEAST = 100

    def __init__(self, quantile: float) -> None:
        self._quantile = quantile
        self._ring: list[float] = []
        self._next = 0
        self._since = 0
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        ring = self._ring
        if len(ring) < self.WINDOW:
            ring.append(seconds)
        else:
            ring[self._next] = seconds
            self._next = (self._next + 1) % self.WINDOW
        self._since += 1
        if self._since >= self.EVERY and len(ring) >= self.LEAST:
            self._since = 0
            ordered = sorted(ring)
            self.value = ordered[min(len(ordered) - 1, int(self._quantile * len(ordered)))]


class KeptPerSecond:
    """A token bucket: ``per_s`` kept calls a second, as many in a burst; 0 is no ceiling."""

    def __init__(self, per_s: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self._per_s = float(per_s)
        self._tokens = float(per_s)
        self._clock = clock
        self._at = clock.monotonic()

    def take(self) -> bool:
        if self._per_s <= 0:
            return True
        now = self._clock.monotonic()
        self._tokens = min(self._per_s, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class KeepRules:
    """The slow threshold (``slow_ms``, or the recent ``quantile`` of the root's name when
    ``slow_ms`` is 0) and the ceiling (``max_per_s``)."""

    def __init__(
        self, slow_ms: int, quantile: float, max_per_s: int, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._slow_s = slow_ms / 1000.0 if slow_ms > 0 else None
        self._quantile = quantile
        self._recent: dict[str, RecentQuantile] = {}
        self.ceiling = KeptPerSecond(max_per_s, clock)

    def slow(self, name: str, seconds: float) -> bool:
        """Whether a call of ``name`` that took ``seconds`` is slow; then counts it in."""
        if self._slow_s is not None:
            return seconds > self._slow_s
        recent = self._recent.get(name)
        if recent is None:
            if len(self._recent) >= 64:  # span names a caller could vary: never unbounded
                return False
            recent = self._recent[name] = RecentQuantile(self._quantile)
        threshold = recent.value
        recent.add(seconds)
        return threshold is not None and seconds > threshold


def keep_reason(
    spans: Sequence[_Recorded], root: _Recorded, sampled: bool, rules: KeepRules
) -> str | None:
    """Why the call whose root is ``root`` is kept, or None (module doc). Every call's
    duration counts towards its method's recent quantile, whatever else keeps it."""
    assert root.end_time is not None
    slow = rules.slow(root.name, (root.end_time - root.start_time) / 1e9)
    for span in spans:
        attributes = span.attributes
        status = attributes.get("fanout.task.status")
        if status is None:
            continue
        reason = _TASK_REASONS.get(status)
        if reason is None and status == "SKIPPED":
            reason = _SKIP_REASONS.get(attributes.get("fanout.task.skip_reason", ""))
        if reason is not None:
            return reason
    if root.status.status_code is StatusCode.ERROR:
        return "error"
    if slow:
        return "slow"
    return "sampled" if sampled else None
