"""Threaded baseline: thriftpy2's ``TThreadedServer`` and a ``ThreadPoolExecutor`` fan-out.

What most teams would write instead of Fanout: no gevent patching, one OS thread per
connection (``TThreadedServer``, framed transport, Cython binary protocol), and each
call submits its lookups to a module-level ``concurrent.futures.ThreadPoolExecutor``
(``--max-workers``, default 32), waits for them until the request deadline, and reports
the ones still running as ``TIMEOUT``. Same settings file, lookups and response
mapping as Fanout (:mod:`bench.baselines.common`).

The lookups run in plain threads: pymongo and requests block their thread. (The HTTP
lookups' whole-exchange ``gevent.Timeout`` makes a gevent hub in each worker thread and
never fires there, since nothing runs that hub; requests' own connect and read
timeouts still bound every call.)

    python -m bench.baselines.threaded --config bench.toml [--max-workers 32]

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from thriftpy2.protocol import TCyBinaryProtocolFactory
from thriftpy2.server import TThreadedServer
from thriftpy2.thrift import TProcessor
from thriftpy2.transport import TCyFramedTransportFactory, TServerSocket, TSocket

from bench.baselines.common import (
    BaselineHandler,
    PlannedLookup,
    lookup_outcome,
    settings_from_argv,
    timeout_outcome,
)
from bench.servers.ready import announce_ready
from lookups.backends.collection import Backends
from lookups.deadline import Deadline
from lookups.panels import Window
from lookups.registry import default_registry
from service.engine.tasks import TaskOutcome
from service.idl import appstats

__all__ = ["DEFAULT_MAX_WORKERS", "ThreadedHandler", "main"]

DEFAULT_MAX_WORKERS = 32
_BACKLOG = 256  # gevent StreamServer's default, as the other servers have

# Created in main() with --max-workers; module-level, as such code usually has it.
EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None


class ThreadedHandler(BaselineHandler):
    """Submits the planned lookups to :data:`EXECUTOR` and waits until the deadline."""

    def gather(
        self, window: Window, planned: Sequence[PlannedLookup], deadline: Deadline
    ) -> list[TaskOutcome]:
        assert EXECUTOR is not None, "main() creates the executor"
        started = time.monotonic()
        futures = [
            EXECUTOR.submit(lookup_outcome, lookup, window, timeout_ms, deadline)
            for lookup, timeout_ms in planned
        ]
        done, _ = concurrent.futures.wait(futures, timeout=deadline.remaining_s())
        outcomes = []
        for (lookup, _), future in zip(planned, futures):
            if future in done:
                outcomes.append(future.result())
            else:
                future.cancel()
                outcomes.append(
                    timeout_outcome(
                        lookup, (time.monotonic() - started) * 1000.0, "request deadline passed"
                    )
                )
        return outcomes


class _BoundServerSocket(TServerSocket):  # type: ignore[misc]  # thriftpy2 is untyped
    """Listens from construction, so the port the kernel chose for port 0 is known."""

    def __init__(self, host: str, port: int, client_timeout_ms: int) -> None:
        super().__init__(host=host, port=port, client_timeout=client_timeout_ms, backlog=_BACKLOG)
        super().listen()

    def listen(self) -> None:
        """Already listening (TThreadedServer.serve calls this again)."""

    def accept(self) -> TSocket:
        client = super().accept()
        # As Fanout's and the bare server do: a reply never waits on Nagle's algorithm.
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client

    @property
    def address(self) -> tuple[str, int]:
        assert self.sock is not None
        host, port = self.sock.getsockname()[:2]
        return host, port


def _exit_on_signal(signum: int, frame: Any) -> NoReturn:
    # Raised in the main thread, out of the blocking accept() of serve().
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    global EXECUTOR
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--max-workers", type=int, default=DEFAULT_MAX_WORKERS)
    args, rest = own.parse_known_args(argv if argv is not None else sys.argv[1:])
    settings = settings_from_argv("python -m bench.baselines.threaded", rest)
    EXECUTOR = concurrent.futures.ThreadPoolExecutor(
        max_workers=args.max_workers, thread_name_prefix="lookup"
    )
    backends = Backends(settings.backends)
    handler = ThreadedHandler(settings, default_registry().build(backends))
    listener = _BoundServerSocket(
        settings.server.host, settings.server.port, settings.server.idle_timeout_ms
    )
    server = TThreadedServer(
        TProcessor(appstats.AppStats, handler),
        listener,
        itrans_factory=TCyFramedTransportFactory(),
        iprot_factory=TCyBinaryProtocolFactory(),
        daemon=True,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    host, port = listener.address
    announce_ready(host=host, port=port, server="threaded", max_workers=args.max_workers)
    try:
        server.serve()
    except SystemExit:
        pass
    finally:
        listener.close()
        EXECUTOR.shutdown(wait=True, cancel_futures=True)
        backends.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
