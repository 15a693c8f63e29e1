"""The assembled service: backends, lookups, engine, handler and Thrift server.

This is the composition root: the one place that turns :class:`Settings` into
running parts. ``fanout serve``, ``fanout demo`` and the integration tests all
start the service through :class:`FanOutService`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable

from thriftpy2.thrift import TProcessor

from lookups.backends.collection import Backends
from lookups.backends.http import HttpBackend
from lookups.base import Lookup
from lookups.cache.stores import BucketStore
from lookups.cache.wiring import open_store, with_cache
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.plugins import add_configured, add_entry_points
from lookups.registry import LookupRegistry, default_registry
from service.engine.coalescing import Coalescer
from service.engine.fanout import FanOut
from service.errors import ConfigError
from service.idl import appstats
from service.listener.handover import MoveSink
from service.listener.server import DrainReport, ThriftServer
from service.operations import service_metrics
from service.operations.health import CHECK_INTERVAL_S, HealthChecker
from service.operations.hub_monitor import HubMonitor
from service.operations.probes import ProbeServer
from service.operations.snapshot import ServiceParts
from service.overload.gate import CallGate, UnreadRefusals
from service.rpc.handler import AppStatsHandler
from service.settings.checks import pool_warnings
from service.settings.config import Settings, as_config_error

__all__ = ["FanOutService", "read_timeout_warnings"]

log = logging.getLogger(__name__)

# Abandoned tasks end within fanout.abandon_grace_ms, then the reaper's kill; this covers it.
_REAPER_MARGIN_S = 2.0


class FanOutService:
    """One running Fanout server. Use :meth:`start` and :meth:`stop`, or ``with``.

    Tracing is process-wide and set up by the caller (see ``tracing.setup``),
    before the service starts.
    """

    def __init__(
        self,
        settings: Settings,
        registry: LookupRegistry | None = None,
        listener: socket.socket | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock`` is the one every part reads (:mod:`lookups.clock`); tests give their own."""
        self.settings = settings
        self.clock = clock
        for warning in pool_warnings(settings):
            log.warning("configuration: %s", warning)
        registry = _with_plugins(registry, settings)
        unknown = sorted(set(settings.lookups) - set(registry.names()))
        if unknown:
            # Its keys would apply to nothing: a misspelt panel name must not pass quietly.
            raise ConfigError(
                f"lookups.{unknown[0]}: no such lookup; known: {', '.join(registry.names())}"
            )
        with as_config_error():
            self.backends = Backends(
                settings.backends,
                settings.lookups,
                {name: settings.backend_section(name) for name in settings.backends},
                clock,
            )
        self.fanout = FanOut(settings.fanout, clock)
        self.gate = CallGate(
            settings.admission,
            settings.fanout.request_deadline_ms,
            pools_short=lambda: any(b.meter.report().limited_by == "slots" for b in self.backends),
            clock=clock,
            weights=settings.caller_weights(),
        )
        self.health = HealthChecker(self.backends, clock=clock)
        with as_config_error():
            lookups = registry.build(self.backends, settings.plugin_settings)
        for warning in read_timeout_warnings(settings, lookups.values()):
            log.warning("configuration: %s", warning)
        #: The results cache's store (None when ``cache.enabled`` is false).
        self.cache: BucketStore | None = None
        if settings.cache.enabled:
            self.cache = open_store(settings.cache, clock)
            lookups = with_cache(lookups, settings.cache, self.cache)
        self.hub_monitor = HubMonitor(settings.server.hub_block_threshold_ms)
        #: What the handler runs calls through, and what pool_stats() and the metrics read.
        self.parts = ServiceParts(
            clock,
            self.fanout,
            self.gate,
            self.backends,
            self.health,
            coalescer=Coalescer() if settings.fanout.coalesce else None,
            cache=self.cache,
            cache_max_bytes=0 if settings.cache.url else settings.cache.max_bytes,
            hub_monitor=self.hub_monitor,
        )
        self.handler = AppStatsHandler(
            settings, lookups, self.parts, draining=lambda: self.server.draining
        )
        admission = settings.admission
        self.server = ThriftServer(
            TProcessor(appstats.AppStats, self.handler),
            settings.server,
            listener=listener,
            refuse_unread=(
                UnreadRefusals(self.gate, settings.server.protocol)
                if admission.enabled and admission.hold_refusals
                else None
            ),
            clock=clock,
        )
        service_metrics.observe(self.parts)
        self.probes: ProbeServer | None = None
        #: Set (by a pre-forked group's worker) to move connections there on the drain.
        self.drain_moves_to: MoveSink | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> FanOutService:
        self.server.start()
        self.health.watch(CHECK_INTERVAL_S)
        self.gate.dimmer.start()
        if self.settings.server.probe_port >= 0:
            server = self.settings.server
            self.probes = ProbeServer(
                server.probe_bind_host,
                server.probe_port,
                self.health,
                lambda: self.server.draining,
                stale_after_s=server.worker_heartbeat_timeout_ms / 1000.0,
                stores=self.parts.stores,
                clock=self.clock,
            ).start()
        self.hub_monitor.start()
        host, port = self.address
        log.info(
            "serving AppStats on %s:%d (%s transport, %s protocol)",
            host,
            port,
            self.settings.server.transport,
            self.settings.server.protocol,
        )
        return self

    def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Stop accepting, let calls in flight finish (up to ``timeout_s``, default
        ``server.drain_timeout_ms``), close every connection, end abandoned tasks."""
        report = self.server.stop(timeout_s, move_to=self.drain_moves_to)
        grace_s = self.settings.fanout.abandon_grace_ms / 1000.0
        if not self.fanout.wait_reapers(timeout_s=grace_s + _REAPER_MARGIN_S):
            log.warning(
                "drain: abandoned tasks still running after %.1f s", grace_s + _REAPER_MARGIN_S
            )
        return report

    def close(self) -> None:
        """Close the backends' clients, stop the hub monitor; idempotent."""
        self.hub_monitor.stop()
        self.health.stop_watching()
        self.gate.dimmer.stop()
        if self.probes is not None:
            self.probes.stop()
        self.fanout.failures.flush()
        self.backends.close()
        if self.cache is not None:
            self.cache.close()

    def stop(self, timeout_s: float | None = None) -> DrainReport:
        """:meth:`drain`, then :meth:`close`."""
        try:
            return self.drain(timeout_s)
        finally:
            self.close()

    def __enter__(self) -> FanOutService:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _with_plugins(registry: LookupRegistry | None, settings: Settings) -> LookupRegistry:
    """The given registry, or the built-in lookups with every installed ``fanout.lookups``
    entry point; either way plus the factories ``[lookups.<name>] factory`` names."""
    with as_config_error():
        if registry is None:
            registry = default_registry()
            add_entry_points(registry)
        add_configured(
            registry,
            {name: policy.factory for name, policy in settings.lookups.items() if policy.factory},
        )
    return registry


def read_timeout_warnings(settings: Settings, lookups: Iterable[Lookup]) -> list[str]:
    """HTTP panels whose timeout is longer than their backend's ``read_timeout_ms``, which caps
    each attempt's wait for the service's answer (the rest of their time goes to retries)."""
    warnings = []
    for lookup in lookups:
        backend = getattr(lookup, "backend", None)
        if not isinstance(backend, HttpBackend):
            continue
        read_ms, timeout_ms = (
            backend.settings.read_timeout_ms,
            settings.task_timeout_ms(lookup.name),
        )
        if timeout_ms > read_ms:
            warnings.append(
                f"lookups.{lookup.name}.timeout_ms ({timeout_ms}) > read_timeout_ms of "
                f"backend {backend.name} ({read_ms}): each attempt of the "
                f"{lookup.name} panel waits at most {read_ms} ms for an answer"
            )
    return warnings
