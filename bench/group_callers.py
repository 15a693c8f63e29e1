"""Callers that keep their connections, as a web tier's Thrift pool does, for ``bench.group``.

Each caller is a plain thriftpy2 client on one connection, calling ``get_app_stats``
back to back. A failed call is counted by kind, and that caller connects again
(as a pool replaces a broken connection); an answer with a panel not ``OK`` is
counted as incomplete. The tests of several workers use them too. Every call's start and duration is kept,
so the longest stall any caller saw can be read off.
"""

from __future__ import annotations

import time
from typing import Any

import gevent
from thriftpy2.rpc import make_client
from thriftpy2.transport import TCyFramedTransportFactory

from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS

__all__ = ["Callers"]


class Callers:
    """``count`` persistent plain Thrift connections to ``port`` calling until :meth:`stop`."""

    def __init__(self, port: int, count: int, timeout_ms: int = 10_000) -> None:
        self.port, self.timeout_ms = port, timeout_ms
        self.ok = 0
        self.incomplete = 0  # answered, but some panel not OK
        #: Of those panels, how many by "status error_type" (what a failed test shows).
        self.not_ok: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.calls: list[tuple[float, float, bool]] = []  # (started, seconds, answered)
        self._request = appstats.StatsRequest(
            app="shop", start_ms=SAMPLE_START_MS, end_ms=SAMPLE_END_MS
        )
        self._finishing = False
        self._greenlets = [gevent.spawn(self._call) for _ in range(count)]

    def _connect(self) -> Any:
        return make_client(
            appstats.AppStats,
            "127.0.0.1",
            self.port,
            timeout=self.timeout_ms,
            trans_factory=TCyFramedTransportFactory(),
        )

    def _call(self) -> None:
        client = self._connect()
        while not self._finishing:
            started = time.monotonic()
            try:
                response = client.get_app_stats(self._request)
                self.calls.append((started, time.monotonic() - started, True))
                missing = [o for o in response.outcomes if o.status != appstats.TaskStatus.OK]
                if not missing:
                    self.ok += 1
                else:
                    self.incomplete += 1
                    for outcome in missing:
                        kind = f"{outcome.name} {outcome.status} {outcome.error_type}"
                        self.not_ok[kind] = self.not_ok.get(kind, 0) + 1
            except Exception as exc:
                self.calls.append((started, time.monotonic() - started, False))
                kind = type(exc).__name__
                self.failures[kind] = self.failures.get(kind, 0) + 1
                client.close()
                gevent.sleep(0.05)
                client = self._reconnect()
            gevent.sleep(0.002)

    def _reconnect(self) -> Any:
        while True:
            try:
                return self._connect()
            except Exception:
                gevent.sleep(0.1)

    def longest_stall_s(self, since: float = 0.0) -> float:
        """The longest call (answered or failed) that started after ``since``."""
        return max((seconds for started, seconds, _ in self.calls if started >= since), default=0.0)

    def failed(self) -> int:
        return sum(self.failures.values())

    def answered(self) -> int:
        """Calls the server answered: with panels, or with an exception the IDL declares."""
        declared = sum(n for kind, n in self.failures.items() if hasattr(appstats, kind))
        return self.ok + self.incomplete + declared

    def finish(self, timeout_s: float = 30.0) -> None:
        """Let each caller finish the call it has under way, then stop: every call sent is
        then counted here as it is on the server."""
        self._finishing = True
        gevent.joinall(self._greenlets, timeout=timeout_s)
        self.stop()

    def stop(self) -> None:
        gevent.killall(self._greenlets)
