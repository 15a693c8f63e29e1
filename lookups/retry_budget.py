"""A retry budget: retries may be at most a share of calls, however badly things go.

A token bucket, as Finagle's ``RetryBudget`` and gRPC's ``retryThrottling``: each
call deposits ``ratio`` of a token, each retry withdraws a whole one, and the
balance never exceeds ``max_tokens``. It starts with ``reserve`` tokens, so the
first few failures of a quiet caller may still be retried. Over any stretch,
retries <= ratio x calls + max_tokens. When the backend (or the server) is
failing everything, retries thus add at most ``ratio`` to its load.

Shared by the lookups' retries and the web tier's client. Not thread-safe by
design: one budget lives in one gevent hub.
"""

from __future__ import annotations

__all__ = ["RetryBudget"]


class RetryBudget:
    """Allow retries up to ``ratio`` of calls, plus a small reserve."""

    def __init__(self, ratio: float = 0.1, reserve: float = 3.0, max_tokens: float = 10.0) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio: must be within 0..1, got {ratio}")
        if reserve < 0 or max_tokens < max(reserve, 1.0):
            raise ValueError("reserve: must be >= 0, and max_tokens at least reserve and 1")
        self.ratio = ratio
        self.max_tokens = max_tokens
        self._tokens = reserve
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
        if self._tokens < 1.0:
            self.refused += 1
            return False
        self._tokens -= 1.0
        self.retries += 1
        return True

    def __repr__(self) -> str:
        return (f"<RetryBudget {self.ratio:.0%} balance={self._tokens:.1f} calls={self.calls} "
                f"retries={self.retries} refused={self.refused}>")
