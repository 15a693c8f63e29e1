"""One server process from start to exit: serve until SIGTERM or SIGINT, then drain.

The drain, in order, each phase logged at INFO with its counts:

0. with ``server.lame_duck_ms`` > 0, first a lame-duck period: ``health()``
   answers DRAINING while the server still accepts and serves, so load
   balancers and clients move away;
1. the listener closes (new connections are refused) and idle connections
   close at once;
2. each call in flight finishes and is answered, then its connection closes;
   connections still busy after ``server.drain_timeout_ms`` are killed (logged
   as a WARNING with the count);
3. abandoned fan-out tasks end (``fanout.abandon_grace_ms``);
4. the MongoDB client and the HTTP sessions close;
5. the metrics scrape endpoint closes, and pending spans are flushed, for at
   most ``tracing.flush_timeout_ms``.

The exit code is 0 after a drain, including one that had to kill calls at the
timeout: the operator asked the process to stop and it stopped within the time
it was given. Killed calls are counted in the WARNING line, and their callers
see the connection close (a transport error, safe to retry elsewhere).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable

import gevent
from gevent.event import Event
from prometheus_client import generate_latest

from lookups.clock import SYSTEM_CLOCK, Clock
from service.app import FanOutService
from service.operations.metrics_endpoint import MetricsEndpoint
from service.settings.config import Settings, as_config_error
from tracing.metrics import configure_metrics
from tracing.setup import Tracing, build_resource, configure_tracing

__all__ = ["run_server", "tune_collector", "STOP_SIGNALS", "GC_YOUNG_THRESHOLD"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Tracked objects allocated (net) before a young collection; Python's default is 700.
GC_YOUNG_THRESHOLD = 50_000


def run_server(
    settings: Settings,
    *,
    listener: socket.socket | None = None,
    on_ready: Callable[[tuple[str, int]], None] | None = None,
    install_signals: bool = True,
    stop: Event | None = None,
    on_metrics: Callable[[tuple[str, int]], None] | None = None,
    on_service: Callable[[FanOutService], None] | None = None,
    on_drained: Callable[[bytes], None] | None = None,
    tune_gc: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> int:
    """Serve ``settings`` until SIGTERM/SIGINT (or ``stop`` is set), drain, return the exit code.

    Configures tracing and metrics (``settings.tracing``, ``settings.metrics``;
    a Prometheus exporter's scrape endpoint starts, and ``on_metrics(address)``
    is told where), starts :class:`FanOutService` (on ``listener`` if given: a
    bound, listening socket, as pre-forked workers share), calls
    ``on_service(service)`` and then ``on_ready(address)`` once listening, and blocks; once
    drained, with a Prometheus exporter, ``on_drained(exposition)`` gets the last counts. A signal
    arriving during the drain is logged and otherwise ignored: the drain is
    already bounded. With ``install_signals`` false no handler is installed and
    only ``stop`` ends the wait. With ``tune_gc``, once serving the process's garbage
    collector is tuned by :func:`tune_collector`: for a process that exists to serve
    (``fanout serve``, a worker), not one that embeds the server. ``clock`` is the
    service's (:mod:`lookups.clock`): its parts, the metrics endpoint and the span flush
    read it; the lame duck and the drain's bound count real time, as the supervisor
    counts a stop's grace. Returns 0 after the drain in the module doc.

    Raises OSError if it cannot listen, :class:`~service.settings.config.ConfigError`
    (:class:`~service.wire.tls.TlsConfigError` for unusable TLS files) for settings it
    cannot use, ValueError without signal handlers and without ``stop``.
    """
    if not install_signals and stop is None:
        raise ValueError("run_server: without signal handlers, pass a stop event")
    stop = stop or Event()
    with contextlib.ExitStack() as cleanup:  # undone in reverse: drain, close, metrics, spans
        with as_config_error():
            tracing = configure_tracing(settings.tracing)
            cleanup.callback(_flush_spans, tracing, settings.tracing.flush_timeout_ms, clock)
            meters = configure_metrics(settings.metrics, resource=build_resource(settings.tracing))
            cleanup.callback(meters.shutdown)
        if meters.registry is not None and meters.scrape_at is not None:
            endpoint = MetricsEndpoint(meters.registry, *meters.scrape_at, clock=clock).start()
            cleanup.callback(endpoint.stop)
            if on_metrics is not None:
                on_metrics(endpoint.address)
        service = FanOutService(settings, listener=listener, clock=clock)
        cleanup.callback(_close, service)
        service.start()
        if on_drained is not None and (registry := meters.registry) is not None:
            # After the drain (registered later, undone first): every call answered is counted.
            cleanup.callback(lambda: on_drained(generate_latest(registry)))
        if tune_gc:
            tune_collector()
        cleanup.callback(service.drain)
        signals = _StopSignals(stop) if install_signals else None
        if signals is not None:
            cleanup.callback(signals.cancel)
        if on_service is not None:
            on_service(service)
        if on_ready is not None:
            on_ready(service.address)
        stop.wait()
        received = signals.received if signals and signals.received else "stop request"
        if service.drain_moves_to is not None:
            received = "retirement"  # its connections move: no lame duck needed
        elif settings.server.lame_duck_ms:
            log.info(
                "drain: %s received; lame duck for %d ms: reporting DRAINING, still serving",
                received,
                settings.server.lame_duck_ms,
            )
            service.server.enter_lame_duck()
            gevent.sleep(settings.server.lame_duck_ms / 1000.0)
        log.info(
            "drain: %s received; draining for up to %d ms",
            received,
            settings.server.drain_timeout_ms,
        )
    return 0


def tune_collector() -> None:
    """Freeze what start-up built and make young collections rarer, for a serving process.

    Measured under a closed loop at 50 connections (gc callbacks, CPU of the collector
    over the measured windows): with Python's defaults the collector took a large share
    of the CPU, with frequent full collections long enough to block the event loop (the
    hub monitor's "event loop blocked" lines); after ``gc.freeze()`` (the modules,
    clients and settings are never scanned again) and a young threshold of
    :data:`GC_YOUNG_THRESHOLD`, a fraction of that, in short young collections and no
    full one. Reference cycles are still collected.

    50,000 rather than 10,000: the count is net of what reference counting frees, so it
    grows with what calls in flight keep alive; under overload 10,000 meant several
    young collections a second, a tenth of the core, and 50,000 a few in ten seconds,
    with more complete calls and the same RSS.
    """
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def _close(service: FanOutService) -> None:
    service.close()
    log.info("drain: MongoDB client and HTTP sessions closed")


class _StopSignals:
    """SIGTERM and SIGINT set ``stop``; later ones (during the drain) are only logged."""

    def __init__(self, stop: Event) -> None:
        self.received = ""
        self._stop = stop
        self._handlers = [
            gevent.signal_handler(signum, self._on_signal, signum) for signum in STOP_SIGNALS
        ]

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.received:
            log.info("drain: %s received while draining; the drain goes on", name)
            return
        self.received = name
        self._stop.set()

    def cancel(self) -> None:
        for handler in self._handlers:
            handler.cancel()


def _flush_spans(tracing: Tracing, timeout_ms: int, clock: Clock) -> None:
    started = clock.monotonic()
    flushed = tracing.shutdown(timeout_ms)
    elapsed_ms = (clock.monotonic() - started) * 1000.0
    if flushed:
        log.info("drain: spans flushed in %.0f ms", elapsed_ms)
    else:
        log.warning("drain: spans not all flushed within %d ms; continuing", timeout_ms)
