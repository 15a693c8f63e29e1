"""The Fanout instances a client spreads its calls over.

* **Which.** A list of ``(host, port)``, or one DNS name that resolves to
  several addresses (a headless Kubernetes Service), resolved again every
  ``resolve_interval_s``; instances that appear get a pool, those that vanish
  are closed.
* **How.** Power of two choices: of two instances picked at random among the
  eligible ones, the one with fewer calls in flight.
* **Ejection.** An instance whose *new* connection failed (refused, reset: it
  is down or going away) is left out for ``eject_s``, doubling while it keeps
  failing (up to 30 s); when that passes, the next call it gets is its probe,
  and a success takes it back in full. A failure on a *reused* pooled
  connection ejects nothing: the server may simply have closed an idle one.
  With every instance ejected, the one due back first is used anyway.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from service.client.connections import ConnectionPool

__all__ = ["Instance", "Instances", "MAX_EJECT_S"]

#: The longest an instance stays ejected, however often it failed.
MAX_EJECT_S = 30.0


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
    _eject_s: float = field(default=0.0, repr=False)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def eligible(self, now: float) -> bool:
        return now >= self.ejected_until

    def succeeded(self) -> None:
        self._eject_s = 0.0

    def eject(self, base_s: float) -> None:
        self.failures += 1
        self._eject_s = min(MAX_EJECT_S, self._eject_s * 2 if self._eject_s else base_s)
        self.ejected_until = time.monotonic() + self._eject_s


class Instances:
    """The instances of one client; :meth:`pick` chooses one for a call."""

    def __init__(self, addresses: Iterable[tuple[str, int]], make_pool: Callable[[str, int], ConnectionPool],
                 *, resolve: Optional[str] = None, resolve_interval_s: float = 30.0,
                 eject_s: float = 5.0) -> None:
        self._make_pool = make_pool
        self._resolve_name, self._resolve_port = (resolve, 0)
        self._resolve_interval_s = resolve_interval_s
        self._eject_s = eject_s
        self._resolved_at = time.monotonic()
        self._by_address: dict[tuple[str, int], Instance] = {}
        self._update(list(addresses))

    @classmethod
    def from_name(cls, host: str, port: int, make_pool: Callable[[str, int], ConnectionPool],
                  **options: float) -> "Instances":
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
        now, excluded = time.monotonic(), set(map(id, exclude))
        candidates = [i for i in self._by_address.values() if id(i) not in excluded] or self.all
        eligible = [i for i in candidates if i.eligible(now)]
        if not eligible:
            return min(candidates, key=lambda i: i.ejected_until)
        if len(eligible) == 1:
            return eligible[0]
        first, second = random.sample(eligible, 2)
        return first if first.inflight <= second.inflight else second

    def eject(self, instance: Instance) -> None:
        instance.eject(self._eject_s)

    def close(self) -> None:
        for instance in self._by_address.values():
            instance.pool.close()

    def _maybe_resolve(self) -> None:
        if self._resolve_name is None or time.monotonic() - self._resolved_at < self._resolve_interval_s:
            return
        self._resolved_at = time.monotonic()
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
            fresh[(host, port)] = known or Instance(host, port, self._make_pool(host, port))
        for address, gone in self._by_address.items():
            if address not in fresh:
                gone.pool.close()
        self._by_address = fresh


def _resolve(host: str, port: int) -> list[tuple[str, int]]:
    """The distinct addresses ``host`` resolves to for TCP, in the resolver's order."""
    seen: dict[tuple[str, int], None] = {}
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        seen[(sockaddr[0], port)] = None
    return list(seen)
