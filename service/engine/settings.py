"""The engine's settings section, ``[fanout]``."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping, Optional

__all__ = ["FanOutSettings", "AdmissionSettings"]


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
    coalesce: bool = True              # identical lookups in flight at once share one call

    #: Per-key rules the loader applies (service/config.py); other integers must be >= 1.
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"queue_timeout_ms": (0, None), "abandon_grace_ms": (0, None)})


@dataclass(frozen=True)
class AdmissionSettings:
    """The ``[admission]`` section: the adaptive limit on calls in flight and its queue.

    The defaults need no tuning: the limit starts at ``initial_limit`` and follows
    measured latency between ``min_limit`` and ``max_limit``.
    """

    enabled: bool = True
    initial_limit: int = 100           # calls in flight before the first measurements
    min_limit: int = 2
    max_limit: int = 1000
    tolerance: float = 2.0             # latency may rise to this multiple of its long-term average
    max_latency_fraction: float = 0.25  # ...and never past this share of fanout.request_deadline_ms
    queue_interval_ms: int = 100       # CoDel: longest wait while the queue drains now and then
    queue_target_ms: int = 5           # ...and the wait once the queue stands longer than that
    hold_refusals: bool = True         # a caller ignoring retry_after_ms gets its Overloaded late

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    INT_BOUNDS: ClassVar[Mapping[str, tuple[int, Optional[int]]]] = MappingProxyType(
        {"queue_interval_ms": (0, None), "queue_target_ms": (0, None)})

    def __post_init__(self) -> None:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(f"initial_limit: must be between min_limit ({self.min_limit}) and "
                             f"max_limit ({self.max_limit}), got {self.initial_limit}")
        if self.tolerance < 1.0:
            raise ValueError(f"tolerance: must be at least 1.0, got {self.tolerance}")
        if not 0.0 < self.max_latency_fraction <= 1.0:
            raise ValueError(f"max_latency_fraction: must be in (0, 1], got {self.max_latency_fraction}")
