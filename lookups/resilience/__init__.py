"""How lookups survive misbehaving backends.

    budget.py    RetryBudget: retries at most a share of calls (a token bucket)
    breaker.py   CircuitBreaker: fail fast while a backend keeps failing, probe until it heals
    guard.py     BackendGuard: retries within the task's budget, the breaker, hedged requests;
                 one per backend (MongoDB, each HTTP origin), shared by its lookups
    metrics.py   the circuit states and retry counters, as OpenTelemetry metrics
"""

from lookups.resilience.breaker import BreakerPolicy, CircuitBreaker, CircuitState
from lookups.resilience.budget import RetryBudget
from lookups.resilience.guard import BackendGuard, RetryPolicy, live_guards
from lookups.resilience import metrics as _metrics  # noqa: F401  (registers the instruments)

__all__ = ["RetryBudget", "BreakerPolicy", "CircuitBreaker", "CircuitState", "BackendGuard",
           "RetryPolicy", "live_guards"]
