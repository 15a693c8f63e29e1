"""The assembled service: backend clients, lookups, engine, handler and Thrift server.

This is the composition root: the one place that turns :class:`Settings` into
running parts. ``fanout serve``, ``fanout demo`` and the integration tests all
start the service through :class:`FanoutService`.
"""

from __future__ import annotations

import logging
import socket
from typing import Optional

from thriftpy2.thrift import TProcessor

from lookups.clients import Backends
from lookups.registry import LookupRegistry, default_registry
from service.config import Settings, pool_warnings
from service.fanout import FanOut
from service.handler import AppStatsHandler
from service.idl import appstats
from service.server import ThriftServer

__all__ = ["FanoutService"]

log = logging.getLogger(__name__)


class FanoutService:
    """One running Fanout server. Use :meth:`start` and :meth:`stop`, or ``with``.

    Tracing is process-wide and set up by the caller (see ``tracing.setup``),
    before the service starts.
    """

    def __init__(self, settings: Settings, registry: Optional[LookupRegistry] = None,
                 listener: Optional[socket.socket] = None) -> None:
        self.settings = settings
        for warning in pool_warnings(settings):
            log.warning("configuration: %s", warning)
        self.backends = Backends(settings.mongo, settings.http)
        registry = registry or default_registry()
        unknown = sorted(set(settings.lookups) - set(registry.names()))
        if unknown:
            log.warning("configuration: [lookups.%s] names no registered lookup; known: %s",
                        unknown[0], ", ".join(registry.names()))
        self.fanout = FanOut(settings.fanout)
        self.handler = AppStatsHandler(settings, registry.build(self.backends), self.fanout)
        self.server = ThriftServer(TProcessor(appstats.AppStats, self.handler), settings.server,
                                   listener=listener)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> "FanoutService":
        self.server.start()
        host, port = self.address
        log.info("serving AppStats on %s:%d (%s transport, %s protocol)", host, port,
                 self.settings.server.transport, self.settings.server.protocol)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let calls in flight finish, end abandoned tasks, close clients."""
        self.server.stop(timeout_s)
        self.fanout.wait_reapers(timeout_s=timeout_s)
        self.backends.close()

    def __enter__(self) -> "FanoutService":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
