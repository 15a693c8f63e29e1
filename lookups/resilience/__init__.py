"""How lookups survive misbehaving backends.

breaker.py   CircuitBreaker: fail fast while a backend keeps failing, one trial call until it heals
guard.py     BackendGuard: retries before the task's deadline, the breaker, hedged
             requests; one per backend (lookups.backends), shared by its lookups; and
             RetryBudget: retries at most a share of calls (a token bucket)
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, not on import: the web-tier client imports guard.py alone.
_EXPORTS = {
    "RetryBudget": "guard",
    "BreakerPolicy": "breaker",
    "CircuitBreaker": "breaker",
    "CircuitState": "breaker",
    "BackendGuard": "guard",
    "RetryPolicy": "guard",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
