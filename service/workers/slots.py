"""The master's worker slots: which process holds each, and when a dead one comes back.

A worker that exits is restarted after 0.1 s, the delay doubling with each quick
death of its slot (one within 10 s of its start) up to 10 s. More than
``max(10, 3 * N)`` restarts within 60 s is a storm: the master gives up.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

from service.workers.group import WorkerState
from service.workers.heartbeat import Heartbeats

__all__ = ["Slot", "Slots"]

_FIRST_RESTART_DELAY_S = 0.1
MAX_RESTART_DELAY_S = 10.0
_STABLE_AFTER_S = 10.0           # a worker that lived this long resets its slot's backoff
STORM_WINDOW_S = 60.0
#: A serving worker silent this long is reported ``unresponsive`` (beats every 0.5 s).
UNRESPONSIVE_AFTER_S = 1.5
_HEARTBEAT_CHECK_S = 0.5


@dataclass
class Slot:
    """One of the N worker positions; a restarted worker takes its predecessor's slot."""

    index: int
    pid: int = 0
    serial: int = 0              # the worker's number, never reused (its heartbeat file)
    started_at: float = 0.0
    quick_deaths: int = 0        # deaths in a row, each within _STABLE_AFTER_S of its start
    restart_at: Optional[float] = None


class Slots:
    """The slots in index order, with the restart policy over them."""

    def __init__(self, count: int) -> None:
        self._slots = [Slot(index) for index in range(count)]
        self._restarts: deque[float] = deque()

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def storm_limit(self) -> int:
        return max(10, 3 * len(self._slots))

    def add(self) -> Slot:
        self._slots.append(Slot(len(self._slots)))
        return self._slots[-1]

    def remove_last(self) -> Slot:
        return self._slots.pop()

    def replace(self, count: int) -> list[Slot]:
        """New empty slots for ``count`` workers; returns the old ones."""
        old, self._slots = self._slots, [Slot(index) for index in range(count)]
        return old

    def holding(self, pid: int) -> Optional[Slot]:
        return next((slot for slot in self._slots if slot.pid == pid), None)

    def pids(self) -> list[int]:
        return [slot.pid for slot in self._slots if slot.pid]

    def started(self, slot: Slot, pid: int, serial: int) -> None:
        slot.pid, slot.serial, slot.started_at, slot.restart_at = pid, serial, time.monotonic(), None

    def fork_failed(self, slot: Slot) -> None:
        slot.restart_at = time.monotonic() + MAX_RESTART_DELAY_S

    def died(self, slot: Slot) -> Optional[float]:
        """Book ``slot``'s worker's death: the delay before its restart, or ``None`` for a storm."""
        slot.pid = 0
        now = time.monotonic()
        slot.quick_deaths = slot.quick_deaths + 1 if now - slot.started_at < _STABLE_AFTER_S else 1
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - STORM_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > self.storm_limit:
            return None
        delay = min(_FIRST_RESTART_DELAY_S * 2 ** (slot.quick_deaths - 1), MAX_RESTART_DELAY_S)
        slot.restart_at = now + delay
        return delay

    @property
    def recent_restarts(self) -> int:
        return len(self._restarts)

    def due(self) -> list[Slot]:
        """The slots whose restart time has come."""
        now = time.monotonic()
        return [s for s in self._slots if s.restart_at is not None and s.restart_at <= now]

    def cancel_restarts(self) -> None:
        for slot in self._slots:
            slot.restart_at = None

    def next_wake_in(self) -> float:
        """Until the next restart is due, and at least every heartbeat check."""
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        until_restart = min(due) - time.monotonic() if due else _HEARTBEAT_CHECK_S
        return max(0.0, min(until_restart, _HEARTBEAT_CHECK_S))

    def stuck(self, heartbeats: Heartbeats, timeout_ms: int) -> list[Slot]:
        """Slots whose worker's heartbeat is older than ``timeout_ms`` (0: never)."""
        return [slot for slot in self._slots if timeout_ms and slot.pid
                and heartbeats.age_s(slot.serial) * 1000.0 > timeout_ms]

    def states(self, heartbeats: Heartbeats) -> list[WorkerState]:
        """Each slot's state for the group's probes and scrape: ``serving``, ``unresponsive``
        (serving, but its event loop has missed beats), ``starting`` or ``restarting``."""
        states = []
        for slot in self._slots:
            announced = heartbeats.announcement(slot.serial) if slot.pid else None
            if announced is not None and announced.get("pid") == slot.pid:
                silent = heartbeats.age_s(slot.serial) > UNRESPONSIVE_AFTER_S
                states.append((slot.index, "unresponsive" if silent else "serving",
                               announced.get("metrics")))
            else:
                states.append((slot.index, "starting" if slot.pid else "restarting", None))
        return states
