"""Backup requests: a second attempt on another instance once the first is slower than
the recent tail, within a budget (Finagle's ``BackupRequestFilter``, gRPC's hedging).

An instance that hangs (stopped, or its event loop stuck) still accepts
connections, so its calls fail only at their deadline: with three instances
and one hung, about one call in a hundred did. With backup requests a call whose first
attempt has not answered after the ``percentile`` (95th) of recent successful
calls' latencies sends a second attempt to another instance; whichever
answers first is the answer, and the other is stopped (its connection is
closed, never reused). Backups stay within ``ratio`` (5%) of calls plus a
burst of 50, leaving room above the 1% the percentile sends when nothing is
wrong (:class:`~lookups.resilience.guard.RetryBudget`), so a slow
period cannot double the load. Until :data:`MIN_SAMPLES` calls have succeeded
there is no tail to go by, and no backups.

Only ``get_app_stats`` is hedged: it is the call with a deadline worth saving,
and every AppStats method only reads, so a second attempt is safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import gevent
from thriftpy2.transport import TTransportException

from lookups.deadline import Deadline
from lookups.resilience.guard import RetryBudget
from service.client.instances import Instance
from tracing.context import spawn_in_context

__all__ = ["BackupRequests", "race_with_backup", "MIN_SAMPLES", "WINDOW"]

#: Successful calls kept for the tail estimate, and the least needed to hedge at all.
WINDOW = 512
MIN_SAMPLES = 50
#: The estimate is recomputed after this many new samples (sorting is not per call).
_REFRESH_EVERY = 32
#: Never hedge sooner than this: below it a second attempt only adds load.
_MIN_DELAY_S = 0.005
#: Backups the budget allows at once (it refills at ``ratio`` of calls).
_BURST = 50.0


class BackupRequests:
    """When to send a backup attempt, and whether the budget allows one."""

    def __init__(self, percentile: float = 0.99, ratio: float = 0.05) -> None:
        if not 0.0 < percentile < 1.0:
            raise ValueError(f"percentile must be between 0 and 1, got {percentile}")
        self.percentile = percentile
        # A hang makes every call then in flight to the instance want a backup at once,
        # before it is ejected: a burst of up to _BURST backups, 5% over any longer stretch.
        self.budget = RetryBudget(ratio, reserve=_BURST, max_tokens=_BURST)
        self.sent = 0
        self.won = 0
        self._latencies: deque[float] = deque(maxlen=WINDOW)
        self._since_refresh = 0
        self._delay_s: float | None = None

    def record(self, latency_s: float) -> None:
        """A call answered after ``latency_s`` (the attempt that answered)."""
        self._latencies.append(latency_s)
        self._since_refresh += 1
        if self._since_refresh >= _REFRESH_EVERY and len(self._latencies) >= MIN_SAMPLES:
            self._since_refresh = 0
            ordered = sorted(self._latencies)
            self._delay_s = max(
                _MIN_DELAY_S, ordered[min(len(ordered) - 1, int(len(ordered) * self.percentile))]
            )

    def delay_s(self) -> float | None:
        """How long a call waits before its backup; None while the tail is unknown."""
        return self._delay_s

    def allow(self) -> bool:
        """Take one backup from the budget; False when it is spent."""
        return self.budget.try_retry()


def race_with_backup(
    client: Any,
    method: str,
    deadline: Deadline,
    deadline_ms: int,
    build_args: Callable[[int], tuple[Any, ...]],
    delay_s: float,
) -> Any:
    """For ``client`` (an :class:`~service.client.AppStatsClient`): the first attempt, and
    after ``delay_s`` without an answer a backup on another instance if the budget allows;
    the first answer wins, the other attempt is stopped."""
    tried: list[Instance] = []

    def attempt(instance: Instance) -> tuple[bool, Any]:
        # Returns what happened: a greenlet that raised would be reported by the hub.
        try:
            return True, client._call_retrying(
                instance, method, deadline, deadline_ms, build_args, tried
            )
        except Exception as raised:  # noqa: BLE001 - handed to the caller below
            return False, raised

    first = client.instances.pick()
    first_attempt = spawn_in_context(attempt, first)
    attempts = {first_attempt: first}
    clock = deadline.clock
    if not clock.join(first_attempt, clock.monotonic() + delay_s) and client.backups.allow():
        second = client.instances.pick(exclude=tried)  # the first attempt's retry included
        if second not in tried:
            client.backups.sent += 1
            attempts[spawn_in_context(attempt, second)] = second
    pending = list(attempts)
    failure: BaseException | None = None
    try:
        while pending:
            for done in gevent.wait(pending, count=1):
                pending.remove(done)
                answered, outcome = done.value
                if answered or not isinstance(outcome, TTransportException):
                    if attempts[done] is not first:  # the backup answered first
                        client.backups.won += 1
                        client.instances.slow(first)
                    if answered:
                        return outcome
                    raise outcome  # a declared exception is an answer too
                failure = outcome
        assert failure is not None
        raise failure
    finally:
        # Our own connections: a stopped attempt's connection is closed, never reused.
        gevent.killall(pending, block=True, timeout=1.0)
