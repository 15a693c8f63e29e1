"""The master's worker positions: which process holds each, and when a dead one comes back.

A worker that exits is restarted after 100 ms, the delay doubling with each quick
death of its position (one within 10 s of its start) up to 10 s. More than
``max(10, 3 * N)`` restarts within 60 s is a storm: the master gives up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from lookups.clock import SYSTEM_CLOCK, Clock
from service.workers.group import WorkerState
from service.workers.heartbeat import Heartbeats

__all__ = ["Position", "Positions"]

_FIRST_RESTART_DELAY_S = 0.1
MAX_RESTART_DELAY_S = 10.0
_STABLE_AFTER_S = 10.0  # a worker that lived this long resets its position's backoff
STORM_WINDOW_S = 60.0
#: A serving worker silent this long is reported ``unresponsive`` (beats every 500 ms).
UNRESPONSIVE_AFTER_S = 1.5
_HEARTBEAT_CHECK_S = 0.5


@dataclass
class Position:
    """One of the N worker positions; a restarted worker takes its predecessor's position."""

    index: int
    pid: int = 0
    serial: int = 0  # the worker's number, never reused (its heartbeat file)
    started_at: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each within _STABLE_AFTER_S of its start
    restart_at: float | None = None


class Positions:
    """The positions in index order, with the restart policy over them."""

    def __init__(self, count: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._positions = [Position(index) for index in range(count)]
        self._restarts: deque[float] = deque()
        #: Worker exits booked since the group started (retirements on a reload aside).
        self.exits = 0

    def __iter__(self) -> Iterator[Position]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._positions)

    @property
    def storm_limit(self) -> int:
        return max(10, 3 * len(self._positions))

    def add(self) -> Position:
        self._positions.append(Position(len(self._positions)))
        return self._positions[-1]

    def remove_last(self) -> Position:
        return self._positions.pop()

    def replace(self, count: int) -> list[Position]:
        """New empty positions for ``count`` workers; returns the old ones."""
        old, self._positions = self._positions, [Position(index) for index in range(count)]
        return old

    def holding(self, pid: int) -> Position | None:
        return next((position for position in self._positions if position.pid == pid), None)

    def pids(self) -> list[int]:
        return [position.pid for position in self._positions if position.pid]

    def started(self, position: Position, pid: int, serial: int) -> None:
        position.pid, position.serial = pid, serial
        position.started_at, position.restart_at = self._clock.monotonic(), None

    def fork_failed(self, position: Position) -> None:
        position.restart_at = self._clock.monotonic() + MAX_RESTART_DELAY_S

    def died(self, position: Position) -> float | None:
        """Book ``position``'s worker's death: the delay before its restart, or ``None`` for a
        storm."""
        position.pid = 0
        self.exits += 1
        now = self._clock.monotonic()
        quick = now - position.started_at < _STABLE_AFTER_S
        position.quick_deaths = position.quick_deaths + 1 if quick else 1
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - STORM_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > self.storm_limit:
            return None
        delay = min(_FIRST_RESTART_DELAY_S * 2 ** (position.quick_deaths - 1), MAX_RESTART_DELAY_S)
        position.restart_at = now + delay
        result: float | None = delay
        return result

    @property
    def recent_restarts(self) -> int:
        return len(self._restarts)

    def due(self) -> list[Position]:
        """The positions whose restart time has come."""
        now = self._clock.monotonic()
        return [s for s in self._positions if s.restart_at is not None and s.restart_at <= now]

    def cancel_restarts(self) -> None:
        for position in self._positions:
            position.restart_at = None

    def next_wake_in(self) -> float:
        """Until the next restart is due, and at least every heartbeat check."""
        due = [s.restart_at for s in self._positions if s.restart_at is not None]
        until_restart = min(due) - self._clock.monotonic() if due else _HEARTBEAT_CHECK_S
        return max(0.0, min(until_restart, _HEARTBEAT_CHECK_S))

    def stuck(self, heartbeats: Heartbeats, timeout_ms: int) -> list[Position]:
        """Positions whose worker's heartbeat is older than ``timeout_ms`` (0: never)."""
        return [
            position
            for position in self._positions
            if timeout_ms
            and position.pid
            and heartbeats.age_s(position.serial) * 1000.0 > timeout_ms
        ]

    def states(self, heartbeats: Heartbeats) -> list[WorkerState]:
        """Each position's state for the group's probes and scrape: ``serving``, ``unresponsive``
        (serving, but its event loop has missed beats), ``starting`` or ``restarting``."""
        states = []
        for position in self._positions:
            announced = heartbeats.announced_by(position.serial, position.pid)
            if announced is not None:
                silent = heartbeats.age_s(position.serial) > UNRESPONSIVE_AFTER_S
                states.append(
                    (
                        position.index,
                        "unresponsive" if silent else "serving",
                        announced.get("metrics"),
                    )
                )
            else:
                states.append((position.index, "starting" if position.pid else "restarting", None))
        return states
