"""One backend's guard: retries before the task's deadline, a retry budget, a circuit
breaker, and optional hedged requests.

:meth:`BackendGuard.call` runs one attempt after another until one succeeds or:

* the failure is not ``retry_safe`` (see :mod:`lookups.errors`), or
* the lookup's ``attempts`` are used up, or
* the jittered back-off (``RETRY_BACKOFF_MS`` doubling up to ``RETRY_BACKOFF_MAX_MS``,
  "full jitter") would not leave ``MIN_ATTEMPT_MS`` before the deadline for another try, or
* the backend's :class:`RetryBudget` is spent (retries at
  most ``retry_budget_ratio`` of calls, plus 10 a second and a reserve of 3), or
* the circuit breaker is open (:class:`~lookups.errors.CircuitOpen`, at once).

With hedging on for a lookup, an attempt still running after the backend's
observed 95th-percentile latency gets a twin; the first answer wins and the
other is killed (its slot and connection are given back in its ``finally``; a
MongoDB operation runs on in its own never-killed greenlet and ends by its
deadline). A hedge spends the retry budget too. This is Finagle's backup requests.

The task's span gets ``fanout.attempts`` and, after a failed attempt,
``fanout.last_error``; each retry is a ``retry`` event.

**The retry budget** (:class:`RetryBudget`) is a token bucket, as Finagle's
``RetryBudget`` and gRPC's ``retryThrottling``: each call deposits ``ratio`` of a
token, each retry withdraws a whole one, and the balance never exceeds ``max_tokens``.
It starts with ``reserve`` tokens, and earns ``min_per_s`` more each second (Finagle's
``minRetriesPerSec``), so a quiet caller's occasional failures may still be retried.
Over any stretch of ``t`` seconds, retries <= ratio x calls + min_per_s x t +
max_tokens. When the backend (or the server) is failing everything, retries thus add
at most about ``ratio`` to its load. The web tier's client keeps one too. Not
thread-safe by design: one budget lives in one gevent hub.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import gevent
from opentelemetry import trace

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.errors import BackendTimeout, BackendUnavailable, CircuitOpen, LookupFailed
from lookups.resilience.breaker import BreakerPolicy, CircuitBreaker
from tracing.context import spawn_in_context

__all__ = ["RetryPolicy", "BackendGuard", "RetryBudget", "RETRY_BACKOFF_MS", "MIN_ATTEMPT_MS"]

T = TypeVar("T")

RETRY_BACKOFF_MS = 20
RETRY_BACKOFF_MAX_MS = 200
MIN_ATTEMPT_MS = 20
#: A call timing out within a smaller budget than this does not count against its backend.
JUDGED_BUDGET_S = 0.5
_LATENCIES_KEPT = 200
_HEDGE_MIN_SAMPLES = 20
_MIN_RETRIES_PER_S = 10.0


@dataclass(frozen=True)
class RetryPolicy:
    """Per lookup: how many attempts in all, and whether to hedge."""

    attempts: int = 3
    hedge: bool = False


#: The policy of a lookup the settings name none for; shared, as a policy is immutable.
_DEFAULT_POLICY = RetryPolicy()


def _is_backend_fault(error: BaseException, given_s: float) -> bool:
    """Whether a call's failure counts against the backend for its circuit breaker:
    unreachable or timed out, by the backend's doing. Not a bad answer, not the breaker's
    own refusal, not a kill (the engine's reaper) nor a bug of ours, and not a timeout
    of a call given less than :data:`JUDGED_BUDGET_S`: that says more about the caller's
    deadline than about the backend."""
    if isinstance(error, CircuitOpen):
        return False
    if isinstance(error, BackendTimeout):
        return error.backend_fault and given_s >= JUDGED_BUDGET_S
    if isinstance(error, BackendUnavailable):
        return error.backend_fault
    return False


class BackendGuard:
    """Retries, retry budget, breaker and hedging for the backend ``name``."""

    def __init__(
        self,
        name: str,
        breaker: BreakerPolicy,
        retry_budget_ratio: float,
        policies: Mapping[str, RetryPolicy] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``breaker`` and ``retry_budget_ratio`` are the backend's settings (no default here,
        so that there is one: ``[backends.<name>]``'s); ``clock`` times the breaker, the
        budget's refill and the latencies hedging waits on."""
        self.name = name
        self._clock = clock
        self.breaker = CircuitBreaker(name, breaker, clock)
        # A few retries a second on top of the ratio, as Finagle's default budget allows.
        self.budget = RetryBudget(retry_budget_ratio, min_per_s=_MIN_RETRIES_PER_S, clock=clock)
        self._policies = dict(policies or {})
        # The p95 latency is only wanted for hedging: not kept when no lookup hedges.
        self._hedging = any(p.hedge for p in self._policies.values())
        self._latencies: deque[float] = deque(maxlen=_LATENCIES_KEPT)
        self._p95_s: float | None = None
        self._since_p95 = 0
        self.attempts = self.hedges = 0
        #: Calls made, and of those the ones the backend failed (as the breaker judges them).
        self.calls = self.failures = 0

    def policy(self, lookup: str) -> RetryPolicy:
        return self._policies.get(lookup, _DEFAULT_POLICY)

    def call(self, lookup: str, attempt: Callable[[Deadline], T], deadline: Deadline) -> T:
        """``attempt(deadline)`` with retries as in the module doc; raises its last failure.

        The breaker judges the call, not each attempt: a call a retry saved is a success.
        """
        trial = self.breaker.check()
        given_s = deadline.remaining_s()
        failed = True
        try:
            value = self._attempts(lookup, attempt, deadline)
            failed = False
            return value
        except BaseException as error:
            failed = _is_backend_fault(error, given_s)
            raise
        finally:
            self.calls += 1
            self.failures += failed
            self.breaker.record(failed, trial)

    def _attempts(self, lookup: str, attempt: Callable[[Deadline], T], deadline: Deadline) -> T:
        policy = self.policy(lookup)
        self.budget.record_call()
        span = trace.get_current_span()
        for number in range(1, policy.attempts + 1):
            try:
                value = self._once(attempt, deadline, policy.hedge)
                _annotate(span, number, None)
                return value
            except LookupFailed as failure:
                _annotate(span, number, failure)
                if not self._may_retry(failure, number, policy, deadline):
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _may_retry(
        self, failure: LookupFailed, number: int, policy: RetryPolicy, deadline: Deadline
    ) -> bool:
        if not failure.retry_safe or number >= policy.attempts:
            return False
        backoff_ms = random.uniform(
            0, min(RETRY_BACKOFF_MAX_MS, RETRY_BACKOFF_MS * 2 ** (number - 1))
        )
        if deadline.remaining_ms() < backoff_ms + MIN_ATTEMPT_MS:
            return False
        if not self.budget.try_retry():
            return False
        self._clock.sleep(backoff_ms / 1000.0)
        return True

    def _once(self, attempt: Callable[[Deadline], T], deadline: Deadline, hedge: bool) -> T:
        self.attempts += 1
        began = self._clock.monotonic()
        value = self._hedged(attempt, deadline) if hedge else attempt(deadline)
        if self._hedging:
            self._observe(self._clock.monotonic() - began)
        return value

    def _hedged(self, attempt: Callable[[Deadline], T], deadline: Deadline) -> T:
        delay_s = self._p95_s
        if delay_s is None or delay_s >= deadline.remaining_s():
            return attempt(deadline)
        first = spawn_in_context(attempt, deadline)
        answered = self._clock.join(first, self._clock.monotonic() + delay_s)
        if answered or not self.budget.try_retry():
            result: T = first.get()
            return result
        self.hedges += 1
        second = spawn_in_context(attempt, deadline)
        racing = [first, second]
        try:
            while racing:
                done = gevent.wait(racing, count=1)[0]
                racing.remove(done)
                if done.successful() or not racing:
                    winner: T = done.get()
                    return winner
            raise AssertionError("unreachable")
        finally:
            for loser in racing:
                loser.kill(block=False)

    def _observe(self, seconds: float) -> None:
        self._latencies.append(seconds)
        self._since_p95 += 1
        if len(self._latencies) >= _HEDGE_MIN_SAMPLES and self._since_p95 >= 10:
            ordered = sorted(self._latencies)
            self._p95_s = ordered[int(0.95 * (len(ordered) - 1))]
            self._since_p95 = 0

    def __repr__(self) -> str:
        return f"<BackendGuard {self.name} {self.breaker.state.value} {self.budget!r}>"


def _annotate(span: trace.Span, attempts: int, failure: LookupFailed | None) -> None:
    if not span.is_recording() or (attempts == 1 and failure is None):
        return
    span.set_attribute("fanout.attempts", attempts)
    if failure is not None:
        span.set_attribute("fanout.last_error", type(failure).__name__)
        span.add_event(
            "retry" if failure.retry_safe else "attempt failed",
            {"attempt": attempts, "error": type(failure).__name__},
        )


class RetryBudget:
    """Allow retries up to ``ratio`` of calls, plus a small reserve.

    A ``ratio`` of 0 allows no retry at all: the reserve and ``min_per_s`` are then ignored.
    """

    def __init__(
        self,
        ratio: float,
        reserve: float = 3.0,
        max_tokens: float = 10.0,
        min_per_s: float = 0.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio: must be within 0..1, got {ratio}")
        if reserve < 0 or max_tokens < max(reserve, 1.0):
            raise ValueError("reserve: must be >= 0, and max_tokens at least reserve and 1")
        self.ratio = ratio
        self.max_tokens = max_tokens
        self.min_per_s = min_per_s if ratio else 0.0
        self._tokens = reserve if ratio else 0.0
        self._clock = clock
        self._refilled_at = clock.monotonic()
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
        """Withdraw a token for one retry; False (and nothing withdrawn) when the budget is
        spent."""
        if self.min_per_s:
            now = self._clock.monotonic()
            self._tokens = min(
                self.max_tokens, self._tokens + (now - self._refilled_at) * self.min_per_s
            )
            self._refilled_at = now
        if self._tokens < 1.0:
            self.refused += 1
            return False
        self._tokens -= 1.0
        self.retries += 1
        return True

    def __repr__(self) -> str:
        return (
            f"<RetryBudget {self.ratio:.0%} balance={self._tokens:.1f} calls={self.calls} "
            f"retries={self.retries} refused={self.refused}>"
        )
