"""A retry budget: retries may be at most a share of calls, however badly things go.

A token bucket, as Finagle's ``RetryBudget`` and gRPC's ``retryThrottling``: each
call deposits ``ratio`` of a token, each retry withdraws a whole one, and the
balance never exceeds ``max_tokens``. It starts with ``reserve`` tokens, and
earns ``min_per_s`` more each second (Finagle's ``minRetriesPerSec``), so a quiet
caller's occasional failures may still be retried. Over any stretch of ``t``
seconds, retries <= ratio x calls + min_per_s x t + max_tokens. When the backend
(or the server) is failing everything, retries thus add at most about ``ratio``
to its load.

Shared by the lookups' retries and the web tier's client. Not thread-safe by
design: one budget lives in one gevent hub.
"""

from __future__ import annotations

import time

__all__ = ["RetryBudget"]


class RetryBudget:
    """Allow retries up to ``ratio`` of calls, plus a small reserve.

    A ``ratio`` of 0 allows no retry at all: the reserve and ``min_per_s`` are then ignored.
    """

    def __init__(self, ratio: float, reserve: float = 3.0, max_tokens: float = 10.0,
                 min_per_s: float = 0.0) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio: must be within 0..1, got {ratio}")
        if reserve < 0 or max_tokens < max(reserve, 1.0):
            raise ValueError("reserve: must be >= 0, and max_tokens at least reserve and 1")
        self.ratio = ratio
        self.max_tokens = max_tokens
        self.min_per_s = min_per_s if ratio else 0.0
        self._tokens = reserve if ratio else 0.0
        self._refilled_at = time.monotonic()
        self.calls = 0
        self.retries = 0
        self.refused = 0

    @property
    def balance(self) -> float:
        return self._tokens

    def record_call(self) -> None:
        """A first attempt was made: deposit ``ratio`` of a token."""
        self.calls += 1
        self._tokens = min(self.max_tokens, self._tokens + self.ratio)

    def try_retry(self) -> bool:
        """Withdraw a token for one retry; False (and nothing withdrawn) when the budget is spent."""
        if self.min_per_s:
            now = time.monotonic()
            self._tokens = min(self.max_tokens,
                               self._tokens + (now - self._refilled_at) * self.min_per_s)
            self._refilled_at = now
        if self._tokens < 1.0:
            self.refused += 1
            return False
        self._tokens -= 1.0
        self.retries += 1
        return True

    def __repr__(self) -> str:
        return (f"<RetryBudget {self.ratio:.0%} balance={self._tokens:.1f} calls={self.calls} "
                f"retries={self.retries} refused={self.refused}>")
