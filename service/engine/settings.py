"""The engine's settings section, ``[fanout]``."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

__all__ = ["FanOutSettings"]


@dataclass(frozen=True)
class FanOutSettings:
    """Pools, queueing and time budgets of the fan-out engine (all times in milliseconds)."""

    pool_size: int = 16                # tasks of one request running at once
    max_inflight_tasks: int = 1000     # tasks of all requests running at once: the hard cap
    queue_timeout_ms: int = 100        # how long a task may wait for a slot
    request_deadline_ms: int = 2000    # a call's deadline when the caller sends a longer one
    task_timeout_ms: int = 1000        # a task's budget unless its lookup sets timeout_ms
    abandon_grace_ms: int = 500        # how long an abandoned task may run on before it is killed
    max_window_ms: int = 31 * 24 * 3600 * 1000  # the longest time window a request may ask for

    #: Per-key rules the loader applies (service/config.py); other integers must be >= 1.
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"queue_timeout_ms": (0, None), "abandon_grace_ms": (0, None)})
