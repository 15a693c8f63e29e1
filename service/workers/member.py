"""A worker's side of the control line: what the master says, and what it is told back.

From the master: the group's backend checks and every worker's pools
(``group``), connections to serve (``adopt``), connections to hand over
(``move``, ``retire``). To the master: this worker's ``state`` every
:data:`REPORT_S` (connections, pools), each connection it hands over (``moved``), and
once drained its last ``counts``.
The message kinds are listed in :mod:`service.workers.control`. A line that ends
means the master has gone: the worker drains and exits.
"""

from __future__ import annotations

import logging
import socket
import zlib
from typing import TYPE_CHECKING, Any

from gevent.event import Event

from service.operations.snapshot import take
from service.rpc.pool_report import own_report
from service.workers.control import ControlLine
from tracing.context import spawn_in_context

if TYPE_CHECKING:
    from service.app import FanOutService

__all__ = ["GroupMember", "REPORT_S"]

log = logging.getLogger(__name__)

#: How often a worker tells the master its connections and pools.
REPORT_S = 0.5


class GroupMember:
    """One worker in the group. ``stop`` is the event its server waits on."""

    def __init__(self, line: ControlLine, position: int) -> None:
        self.stop = Event()
        self.position = str(position)
        self._line = line
        self._service: FanOutService | None = None
        self._pools: dict[str, dict[str, Any]] = {}

    def attach(self, service: FanOutService) -> None:
        """Once ``service`` serves: follow the master's backend checks, answer for the group's
        pools, and start reading the line and reporting."""
        self._service = service
        service.health.follow(())
        service.handler.group = self
        spawn_in_context(self._read)  # both end when the line does
        spawn_in_context(self._report)

    def pools(self) -> dict[str, dict[str, Any]]:
        """Every serving worker's last pool report, by position (this worker's included)."""
        return self._pools

    def _read(self) -> None:
        for message, fd in self._line.messages():
            try:
                self._on(message, fd)
            except Exception:  # one bad message must not end the line
                log.exception("control message %r failed", message.get("kind"))
        log.warning("the master has gone; draining")
        self.stop.set()

    def _on(self, message: dict[str, Any], fd: int | None) -> None:
        service = self._service
        assert service is not None
        kind = message["kind"]
        if kind == "adopt" and fd is not None:
            service.server.adopt(socket.socket(fileno=fd), message["unread"])
        elif kind == "group":
            service.health.follow(message["backends"])
            self._pools = message["pools"]
        elif kind == "move":
            service.server.move_some(message["count"], self._hand_over)
        elif kind == "retire":
            service.drain_moves_to = self._hand_over
            self.stop.set()

    def last_counts(self, exposition: bytes) -> None:
        """Once drained: send the master this worker's last counts, which outlive it there
        (:mod:`service.workers.counts`)."""
        if not self._line.offer({"kind": "counts", "exposition": zlib.compress(exposition, 1)}):
            log.warning("the last counts could not reach the master; its last scrape stands")

    def _hand_over(self, sock: socket.socket, unread: bytes) -> bool:
        """Send one connection to the master, which gives it to another worker."""
        return self._line.offer({"kind": "moved", "unread": unread}, fd=sock.fileno())

    def _report(self) -> None:
        service = self._service
        assert service is not None
        while self._line.offer(
            {
                "kind": "state",
                "staying": service.server.connection_counts()[1],
                "pools": own_report(take(service.parts)),
                "circuits": service.health.circuits(),
                "stores": service.parts.stores(),
            }
        ):
            service.clock.sleep(REPORT_S)
