"""The engine's settings sections: ``[fanout]``, ``[admission]`` and ``[callers.<name>]``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["FanOutSettings", "AdmissionSettings", "CallerSettings", "CALLER_PATTERN", "CALLER_RULE"]

#: What a caller's name may be: a certificate's DNS name or URI (``spiffe://...``), or a
#: name the caller gives (``RequestMeta.caller``, ``[callers.<name>]``).
CALLER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}")
CALLER_RULE = (
    "must be 1-128 characters of letters, digits, '.', '_', ':', '/', '@' or '-', "
    "starting with a letter or digit"
)


@dataclass(frozen=True)
class FanOutSettings:
    """Pools, queueing and timeouts of the fan-out engine (all times in milliseconds)."""

    pool_size: int = field(
        default=16, metadata={"help": "tasks of one request running at once", "min": 1}
    )
    max_inflight_tasks: int = field(
        default=1000,
        metadata={"help": "tasks running at once in the whole process: the hard cap", "min": 1},
    )
    queue_timeout_ms: int = field(
        default=100,
        metadata={"help": "how long a task may wait for a slot before it is `REJECTED`", "min": 0},
    )
    request_deadline_ms: int = field(
        default=2000,
        metadata={
            "help": "a request's deadline; callers may ask for less with `meta.deadline_ms`",
            "min": 1,
        },
    )
    task_timeout_ms: int = field(
        default=1000, metadata={"help": "default timeout of one task", "min": 1}
    )
    abandon_grace_ms: int = field(
        default=500,
        metadata={
            "help": "how long a task still running after its request answered may go on before "
            "it is killed",
            "min": 0,
        },
    )
    max_window_ms: int = field(
        default=31 * 24 * 3600 * 1000,
        metadata={
            "help": "longest window a request may ask for (the default is 31 days)",
            "min": 1,
        },
    )
    merge_commands: bool = field(
        default=False,
        metadata={
            "help": "the urls and controllers panels of one call answered by one MongoDB command "
            "(a `$facet`) instead of two; they then succeed or fail together (see "
            "[Request coalescing](../reference/limits.md#request-coalescing))"
        },
    )
    coalesce: bool = field(
        default=True,
        metadata={
            "help": "identical lookups in flight at once (same panel, app and window) share one "
            "backend call (see "
            "[Request coalescing](../reference/limits.md#request-coalescing))"
        },
    )


@dataclass(frozen=True)
class AdmissionSettings:
    """The ``[admission]`` section: the adaptive limit on calls in flight and its queue.

    The defaults need no tuning: the limit starts at ``initial_limit`` and follows
    measured latency between ``min_limit`` and ``max_limit``.
    """

    enabled: bool = field(
        default=True,
        metadata={
            "help": "`false`: every call is admitted (only `fanout.max_inflight_tasks` bounds work)"
        },
    )
    initial_limit: int = field(
        default=100,
        metadata={"help": "calls in flight allowed before any latency was measured", "min": 1},
    )
    min_limit: int = field(
        default=2,
        metadata={"help": "least value of the adaptive limit on calls in flight", "min": 1},
    )
    max_limit: int = field(
        default=1000,
        metadata={"help": "greatest value of the adaptive limit on calls in flight", "min": 1},
    )
    tolerance: float = field(
        default=2.0,
        metadata={
            "help": "latency may rise to this multiple of its long-term average before the limit "
            "falls",
            "min": 1.0,
        },
    )
    max_latency_fraction: float = field(
        default=0.25,
        metadata={
            "help": "and never above this share of `fanout.request_deadline_ms` (above 0)",
            "max": 1.0,
        },
    )
    cpu_saturated: float = field(
        default=0.97,
        metadata={
            "help": "while the event loop wanted a core this share of the time (running or "
            "waiting for one), the limit moves a tenth per quarter-second window by how "
            "long calls queue for the core: down while they take over 2.2 times the "
            "least latency, up under 1.6 times; `0` turns this off",
            "max": 1.0,
        },
    )
    queue_interval_ms: int = field(
        default=100,
        metadata={
            "help": "longest wait in the admission queue while it drains now and then (CoDel "
            "interval)",
            "min": 0,
        },
    )
    queue_target_ms: int = field(
        default=5,
        metadata={
            "help": "longest wait once the queue has stood longer than the interval (then served "
            "newest first)",
            "min": 0,
        },
    )
    brownout: bool = field(
        default=True,
        metadata={
            "help": "under overload, shed optional panels and the least critical calls before "
            "anything essential (see "
            "[Brownout and criticality](../explanation/brownout.md))"
        },
    )
    brownout_min_level: float = field(
        default=0.0,
        metadata={
            "help": "the dimmer's level never falls below this (`0..1`): shed by hand, before an "
            "expected peak; `0.2` sheds the optional panels of every `SHEDDABLE` call",
            "max": 1.0,
        },
    )
    hold_refusals: bool = field(
        default=True,
        metadata={
            "help": "hold the `Overloaded` of a caller that came back before its `retry_after_ms` "
            "(see [Capacity and overload](../explanation/overload.md))"
        },
    )

    fair_share: bool = field(
        default=True,
        metadata={
            "help": "once the limit is reached, serve the callers under their fair share of it "
            "before those over theirs (see [Capacity and overload](../explanation/overload.md))"
        },
    )
    max_callers: int = field(
        default=1000,
        metadata={
            "help": "callers tracked for fair share at most; the least recently active are "
            "forgotten first",
            "min": 1,
        },
    )

    def __post_init__(self) -> None:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(
                f"initial_limit: must be between min_limit ({self.min_limit}) and "
                f"max_limit ({self.max_limit}), got {self.initial_limit}"
            )
        if not 0.0 <= self.brownout_min_level <= 1.0:
            raise ValueError(
                f"brownout_min_level: must be in [0, 1], got {self.brownout_min_level}"
            )
        if not 0.0 <= self.cpu_saturated <= 1.0:
            raise ValueError(f"cpu_saturated: must be in [0, 1], got {self.cpu_saturated}")
        if not self.max_latency_fraction > 0.0:
            raise ValueError(
                f"max_latency_fraction: must be in (0, 1], got {self.max_latency_fraction}"
            )


@dataclass(frozen=True)
class CallerSettings:
    """One ``[callers.<name>]`` table: how much of admission's limit the caller ``name``
    (its client certificate's name, or the ``RequestMeta.caller`` it sends) may count on."""

    weight: float = field(
        default=1.0,
        metadata={
            "help": "this caller's share of the limit, against the weights of the callers active "
            "with it (others weigh 1); above 0",
            "min": 0.001,
        },
    )
