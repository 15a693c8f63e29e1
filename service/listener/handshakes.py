"""The TLS handshake of every accepted connection, and what is refused there.

With ``server.tls_cert_file`` and ``server.tls_key_file`` set, each connection first
completes a TLS handshake within ``server.frame_timeout_ms`` (one deadline for the
whole of it, :func:`service.wire.tls.handshake`). With ``server.tls_client_names``
the client's certificate must also name one of them. A refused handshake closes
that connection only: it is counted (``fanout.tls.handshakes.refused`` by
``fanout.tls.reason``) and summed up in one log line every few seconds, never one per
connection. New connections get the certificate files as they are on disk, and
``fanout.tls.certificate.expiration_timestamp`` says when those in use expire.
"""

from __future__ import annotations

import logging
import socket
import ssl
import weakref
from collections.abc import Iterable
from typing import Any

import gevent
from gevent.monkey import get_original
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from service.engine.summary import FailureSummary
from service.listener.stats import ServerStats
from service.settings.server import ServerSettings
from service.wire.certificates import RotatingContext, expires_at
from service.wire.tls import handshake, peer_names, refusal_reason, server_context

__all__ = ["TlsHandshakes"]

log = logging.getLogger(__name__)

_thread_ident = get_original("_thread", "get_ident")
_meter = metrics.get_meter("fanout.server")
_refused_handshakes = _meter.create_counter(
    "fanout.tls.handshakes.refused",
    unit="{connection}",
    description="TLS handshakes refused, by fanout.tls.reason",
)
_listeners: weakref.WeakSet[TlsHandshakes] = weakref.WeakSet()


def _expirations(options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(at, {"fanout.tls.certificate": role})
        for handshakes in list(_listeners)
        for role, at in handshakes.expirations().items()
    ]


_meter.create_observable_gauge(
    "fanout.tls.certificate.expiration_timestamp",
    callbacks=[_expirations],
    unit="s",
    description="When the TLS certificates in use expire (Unix time; the soonest of a chain),"
    " by fanout.tls.certificate: server, client_ca",
)


class TlsHandshakes:
    """Secures accepted sockets for one listener, per ``settings``; counts into ``stats``."""

    def __init__(self, settings: ServerSettings, stats: ServerStats) -> None:
        files = (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
        self._context = RotatingContext(
            lambda: _built(server_context(*files)), [path for path in files if path]
        )
        self._certificates = {"server": settings.tls_cert_file, "client_ca": files[2]}
        self._expirations: tuple[int, dict[str, float]] | None = None  # and at which reload
        _listeners.add(self)
        self._timeout_s = settings.frame_timeout_ms / 1000.0
        self._allowed_names = frozenset(settings.tls_client_names)
        self._stats = stats
        self._refusals = FailureSummary(log, "TLS handshakes refused")
        # The event loop's: the files are looked at again there only (see expirations).
        self._loop, self._loop_thread = gevent.get_hub().loop, _thread_ident()

    def secure(self, sock: socket.socket, peer: Any) -> socket.socket | None:
        """The TLS-wrapped socket, or None (counted) if the handshake was refused."""
        try:
            secured = handshake(self._context.current(), sock, self._timeout_s)
        except (TimeoutError, ssl.SSLError) as exc:
            self._refuse(refusal_reason(exc), peer, getattr(exc, "reason", None) or exc)
            return None
        except OSError as exc:
            log.debug("TLS handshake with %s: connection ended: %s", peer, exc)
            return None
        if self._allowed_names:
            names = peer_names(secured)
            if self._allowed_names.isdisjoint(names):
                secured.close()
                self._refuse("name_not_allowed", peer, ", ".join(names) or "no DNS or URI name")
                return None
        return secured

    def expirations(self) -> dict[str, float]:
        """When the server's certificate and the client CAs in use expire (Unix time), read
        from the files again only once new ones are in use (looked for here too, as when a
        connection arrives: on the event loop, where connections are; an OTLP export
        collects on a thread of its own, and asks the loop to look, for its next export)."""
        if _thread_ident() == self._loop_thread:
            self._context.current()
        else:
            self._loop.run_callback_threadsafe(self._context.current)
        if self._expirations is None or self._expirations[0] != self._context.reloads:
            expiring = {role: expires_at(path) for role, path in self._certificates.items() if path}
            self._expirations = (
                self._context.reloads,
                {role: at for role, at in expiring.items() if at is not None},
            )
        return self._expirations[1]

    def flush(self) -> None:
        """Log the pending summary of refusals (at shutdown)."""
        self._refusals.flush()

    def _refuse(self, reason: str, peer: Any, detail: object) -> None:
        self._stats.tls_refused += 1
        _refused_handshakes.add(1, {"fanout.tls.reason": reason})
        self._refusals.count(reason, f"{peer[0] if isinstance(peer, tuple) else peer}: {detail}")


def _built(context: ssl.SSLContext | None) -> ssl.SSLContext:
    assert context is not None  # built only when server.tls_cert_file is set
    return context
