"""The Fanout instances a client spreads its calls over.

* **Which.** A list of ``(host, port)``, or one DNS name that resolves to
  several addresses (a headless Kubernetes Service), resolved again every
  ``resolve_interval_s``; instances that appear get a pool, those that vanish
  are closed.
* **How.** Power of two choices: of two instances picked at random among the
  eligible ones, the one with fewer calls in flight.
* **Ejection.** An instance whose *new* connection failed (refused, reset: it
  is down or going away) is left out for ``eject_s``, doubling while it keeps
  failing (up to 30 s). So is an instance that was too slow
  :data:`SLOW_EJECT_AFTER` times in a row (a call timed out on it, or a backup
  request on another instance answered first): it accepts connections but does
  not answer, as a hung process does. A failure on a *reused* pooled
  connection ejects nothing: the server may simply have closed an idle one.
* **Rejoining.** When its ejection ends, an instance gets no call until it has
  answered a ``ping`` on a new connection (the client's ``prober``, run in a
  greenlet of its own): a restarting process that listens before it can serve
  costs no call. A failed ping ejects it again. Instances that a name newly
  resolves to are checked the same way before their first call.
* With every instance out, the one due back first is used anyway.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import gevent

from lookups.clock import SYSTEM_CLOCK, Clock
from service.client.connections import ConnectionPool

__all__ = ["Instance", "Instances", "MAX_EJECT_S", "SLOW_EJECT_AFTER"]

#: The longest an instance stays ejected, however often it failed.
MAX_EJECT_S = 30.0
#: Too slow this many times in a row (timeouts, lost backup races): ejected.
SLOW_EJECT_AFTER = 3


@dataclass(eq=False)
class Instance:
    """One address, its connection pool, and what the client knows of its health."""

    host: str
    port: int
    pool: ConnectionPool
    inflight: int = 0
    calls: int = 0
    failures: int = 0
    ejected_until: float = 0.0
    slow_in_a_row: int = 0
    #: Must answer a ping before its next call: after an ejection, or when newly found.
    unproven: bool = False
    probing: bool = False
    _eject_s: float = field(default=0.0, repr=False)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def eligible(self, now: float) -> bool:
        return now >= self.ejected_until and not self.unproven

    def succeeded(self) -> None:
        self._eject_s = 0.0
        self.slow_in_a_row = 0

    def eject(self, base_s: float, now: float) -> None:
        """Out of the choice from ``now``, for ``base_s`` the first time, then twice as long."""
        self.failures += 1
        self.slow_in_a_row = 0
        self.unproven = True
        self._eject_s = min(MAX_EJECT_S, self._eject_s * 2 if self._eject_s else base_s)
        self.ejected_until = now + self._eject_s


class Instances:
    """The instances of one client; :meth:`pick` chooses one for a call."""

    def __init__(
        self,
        addresses: Iterable[tuple[str, int]],
        make_pool: Callable[[str, int], ConnectionPool],
        *,
        resolve: str | None = None,
        resolve_interval_s: float = 30.0,
        eject_s: float = 5.0,
        prober: Callable[[Instance], bool] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: the client's, which ejections and resolving read."""
        self._clock = clock
        self._make_pool = make_pool
        self._prober = prober
        self._resolve_name, self._resolve_port = (resolve, 0)
        self._resolve_interval_s = resolve_interval_s
        self._eject_s = eject_s
        self._resolved_at = self._clock.monotonic()
        self._by_address: dict[tuple[str, int], Instance] = {}
        self._update(list(addresses))
        for instance in self._by_address.values():
            instance.unproven = False  # the ones given at the start are called at once

    @classmethod
    def from_name(
        cls, host: str, port: int, make_pool: Callable[[str, int], ConnectionPool], **options: Any
    ) -> Instances:
        """Every address ``host`` resolves to, on ``port``; resolved again periodically."""
        instances = cls(_resolve(host, port), make_pool, resolve=host, **options)
        instances._resolve_port = port
        return instances

    @property
    def all(self) -> list[Instance]:
        return list(self._by_address.values())

    def pick(self, exclude: Iterable[Instance] = ()) -> Instance:
        """Power of two choices among the eligible instances, ``exclude`` left out if possible."""
        self._maybe_resolve()
        now, excluded = self._clock.monotonic(), set(map(id, exclude))
        self._probe_due(now)
        candidates = [i for i in self._by_address.values() if id(i) not in excluded] or self.all
        eligible = [i for i in candidates if i.eligible(now)]
        if not eligible:
            return min(candidates, key=lambda i: i.ejected_until)
        if len(eligible) == 1:
            return eligible[0]
        first, second = random.sample(eligible, 2)
        return first if first.inflight <= second.inflight else second

    def eject(self, instance: Instance) -> None:
        instance.eject(self._eject_s, self._clock.monotonic())

    def slow(self, instance: Instance) -> None:
        """``instance`` was too slow for a call: ejected after :data:`SLOW_EJECT_AFTER` in a row."""
        instance.slow_in_a_row += 1
        if instance.slow_in_a_row >= SLOW_EJECT_AFTER:
            self.eject(instance)

    def _probe_due(self, now: float) -> None:
        if self._prober is None:
            for instance in self._by_address.values():
                instance.unproven = False  # no way to check: its next call is the check
            return
        for instance in self._by_address.values():
            if instance.unproven and not instance.probing and now >= instance.ejected_until:
                instance.probing = True
                # A plain spawn: the check is no part of the caller's trace (an empty context).
                gevent.spawn(self._probe, instance)

    def _probe(self, instance: Instance) -> None:
        assert self._prober is not None
        try:
            if self._prober(instance):
                instance.unproven = False
                instance.succeeded()
            elif instance.ejected_until <= self._clock.monotonic():
                self.eject(instance)
        finally:
            instance.probing = False

    def close(self) -> None:
        for instance in self._by_address.values():
            instance.pool.close()

    def _maybe_resolve(self) -> None:
        if (
            self._resolve_name is None
            or self._clock.monotonic() - self._resolved_at < self._resolve_interval_s
        ):
            return
        self._resolved_at = self._clock.monotonic()
        try:
            addresses = _resolve(self._resolve_name, self._resolve_port)
        except OSError:
            return  # keep what we have; the next interval tries again
        self._update(addresses)

    def _update(self, addresses: list[tuple[str, int]]) -> None:
        if not addresses:
            raise ValueError("a client needs at least one address")
        fresh = {}
        for host, port in addresses:
            known = self._by_address.get((host, port))
            fresh[(host, port)] = known or Instance(
                host, port, self._make_pool(host, port), unproven=True
            )
        for address, gone in self._by_address.items():
            if address not in fresh:
                gone.pool.close()
        self._by_address = fresh


def _resolve(host: str, port: int) -> list[tuple[str, int]]:
    """The distinct addresses ``host`` resolves to for TCP, in the resolver's order."""
    seen: dict[tuple[str, int], None] = {}
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        seen[(str(sockaddr[0]), port)] = None
    return list(seen)
