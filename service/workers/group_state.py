"""What the master knows of the group and tells it: backend health, pools, connections.

* **Backends.** The master checks every backend itself, every few seconds,
  whatever the traffic (:class:`~service.operations.health.HealthChecker` over its own
  :class:`~lookups.backends.collection.Backends`, which make no other call). Its
  event loop runs no calls, so a busy worker cannot make a backend look slow.
  Each backend's circuit is the worst any serving worker reports (``open``, then
  ``half_open``). That one result goes to the probe bodies here, and to every
  worker every :data:`PUSH_S`, where ``health()`` and ``fanout_backend_up`` report it.
  Beside them the probe bodies show the results cache's Redis, down if any worker's
  last command to it failed.
* **Pools.** Every worker reports its pools twice a second; the master passes
  all of them on, so the worker that answers ``pool_stats()`` answers for the group.
* **Connections.** A worker handing a connection over sends it here; it goes at
  once to the serving worker with the fewest (:meth:`GroupState.place`). Every
  second the master asks the fullest workers to give connections up when the
  group is out of balance (:mod:`service.workers.balance`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from lookups.backends.collection import Backends
from lookups.clock import SYSTEM_CLOCK, Clock
from service.operations.health import CHECK_INTERVAL_S, BackendStatus, HealthChecker
from service.settings.config import Settings, as_config_error
from service.workers.balance import excess
from service.workers.launch import WorkerLink

__all__ = ["GroupState", "PUSH_S"]

log = logging.getLogger(__name__)

#: How often the master tells every worker the group's backend checks and pools.
PUSH_S = 1.0
#: After asking for moves, how long before judging the balance again (reports catch up).
_BALANCE_COOLDOWN_S = 2.0
#: A connection handed over with no serving worker to take it waits this long at most.
_HOMELESS_S = 10.0
_CIRCUIT_ORDER = {"closed": 0, "half_open": 1, "open": 2}


class GroupState:
    """The master's view of its workers (``links``, by pid); ``serving`` lists those that
    may take connections now."""

    def __init__(
        self,
        settings: Settings,
        links: dict[int, WorkerLink],
        serving: Callable[[], list[WorkerLink]],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        self._links = links
        self._serving = serving
        self._backends: Backends | None = None
        self._health: HealthChecker | None = None
        self._pushed_at = 0.0
        self._balanced_at = 0.0
        self._homeless: list[tuple[float, int, bytes]] = []
        self.reconfigure(settings)

    def reconfigure(self, settings: Settings) -> None:
        """Check the backends ``settings`` names from now on."""
        with as_config_error():
            backends = Backends(
                settings.backends,
                settings.lookups,
                {name: settings.backend_section(name) for name in settings.backends},
            )
        self.close()
        self._backends = backends
        self._health = HealthChecker(backends).watch(CHECK_INTERVAL_S)

    def close(self) -> None:
        if self._health is not None:
            self._health.stop_watching()
        if self._backends is not None:
            self._backends.close()

    def backends(self) -> tuple[BackendStatus, ...]:
        """The last round of checks, each circuit the worst a serving worker reports."""
        assert self._health is not None
        worst: dict[str, str] = {}
        for link in self._links.values():
            for name, state in link.circuits.items():
                if _CIRCUIT_ORDER.get(state, 0) > _CIRCUIT_ORDER.get(worst.get(name, ""), 0):
                    worst[name] = state
        return tuple(
            dataclasses.replace(status, circuit=worst.get(status.name, "closed"))
            for status in self._health.current()
        )

    def statuses(self) -> tuple[BackendStatus, ...]:
        """The backends, then the results cache's shared store as the workers last reported
        it: down if any says so (Redis is one for the group), for the probe bodies."""
        stores: dict[str, BackendStatus] = {}
        for link in self._links.values():
            for status in link.stores:
                if status.name not in stores or not status.up:
                    stores[status.name] = status
        return (*self.backends(), *stores.values())

    def connections(self) -> dict[str, int]:
        """Connections each serving worker holds, by position."""
        return {str(link.position): link.connections for link in self._serving()}

    def on_message(self, link: WorkerLink, message: dict[str, Any], fd: int | None) -> None:
        kind = message.get("kind")
        if kind == "state":
            first = link.pools is None
            link.connections = message["staying"]
            link.pools = message["pools"]
            link.circuits = message["circuits"]
            link.stores = message["stores"]
            if first:  # a new worker: it reports the group's backends from its first call
                self._push()  # on, and the others count its pools at once
        elif kind == "moved" and fd is not None:
            self.place(fd, message["unread"], link.pid)
        elif fd is not None:
            os.close(fd)

    def place(self, fd: int, unread: bytes, from_pid: int) -> None:
        """Give a handed-over connection to the serving worker with the fewest; ours closes."""
        try:
            for link in sorted(self._serving(), key=lambda link: link.connections):
                if link.pid != from_pid and link.tell({"kind": "adopt", "unread": unread}, fd):
                    link.connections += 1
                    return
            self._homeless.append((self._clock.monotonic(), os.dup(fd), unread))
        finally:
            os.close(fd)

    def tick(self) -> None:
        """Place what waits, push the group's state, and judge the balance."""
        homeless, self._homeless = self._homeless, []
        for since, fd, unread in homeless:
            if self._clock.monotonic() - since > _HOMELESS_S:
                os.close(fd)  # its caller sees the connection close, as at any worker's end
            else:
                self.place(fd, unread, 0)
        now = self._clock.monotonic()
        if now - self._pushed_at >= PUSH_S:
            self._pushed_at = now
            self._push()
        if now - self._balanced_at >= _BALANCE_COOLDOWN_S:
            self._balance(now)

    def _push(self) -> None:
        serving = self._serving()
        message = self._message(serving)
        for link in serving:
            link.tell(message)

    def _message(self, serving: list[WorkerLink]) -> dict[str, Any]:
        return {
            "kind": "group",
            "backends": self.backends(),
            "pools": {str(link.position): link.pools for link in serving if link.pools},
        }

    def _balance(self, now: float) -> None:
        serving = {link.pid: link for link in self._serving()}
        for pid, count in excess({pid: link.connections for pid, link in serving.items()}).items():
            if serving[pid].tell({"kind": "move", "count": count}):
                self._balanced_at = now
                log.info(
                    "master: worker %d holds %d of %d connections; moving %d to the others",
                    pid,
                    serving[pid].connections,
                    sum(link.connections for link in serving.values()),
                    count,
                )
