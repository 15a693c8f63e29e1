"""TLS for the Thrift listener and its clients: TLS 1.2 or later, contexts built once.

The server's context comes from ``server.tls_cert_file`` and ``server.tls_key_file``
(PEM; the certificate file may hold the chain). Clients verify the server against
a CA file and a host name; there is no option to skip verification.

The server performs the handshake itself, on the accepted socket, under a timeout
(see :func:`handshake`), so a peer that connects and sends nothing holds its
connection slot for at most that long.
"""

from __future__ import annotations

import socket
import ssl
from typing import Optional

import gevent.ssl

from service.config import ConfigError, ServerSettings

__all__ = ["TlsConfigError", "server_context", "client_context", "handshake", "MINIMUM_VERSION"]

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TlsConfigError(ConfigError):
    """The certificate, key or CA file cannot be read or does not fit; raised at start-up."""


def server_context(settings: ServerSettings) -> Optional[ssl.SSLContext]:
    """The listener's context, or ``None`` when ``server.tls_cert_file`` is empty.

    Raises :class:`TlsConfigError` naming the key when a file cannot be loaded.
    """
    if not settings.tls_cert_file:
        return None
    # gevent's context wraps gevent sockets cooperatively whether or not ssl is patched.
    context = gevent.ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    try:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"server.tls_cert_file / server.tls_key_file: cannot load "
                             f"{settings.tls_cert_file} with {settings.tls_key_file}: "
                             f"{_reason(exc)}") from None
    return context


def client_context(ca_file: str) -> ssl.SSLContext:
    """A verifying client context trusting the CAs in ``ca_file`` (PEM).

    Raises :class:`TlsConfigError` when the file cannot be loaded.
    """
    # Looked up at call time so a gevent-patched process gets gevent's context.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = MINIMUM_VERSION
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load CA file {ca_file}: {_reason(exc)}") from None
    return context


def handshake(context: ssl.SSLContext, sock: socket.socket, timeout_s: float) -> ssl.SSLSocket:
    """Wrap an accepted ``sock`` and complete the server side of the handshake.

    Raises ``TimeoutError`` when the peer does not finish within ``timeout_s``,
    ``ssl.SSLError`` when it does not speak TLS or fails the handshake, ``OSError``
    when the connection breaks. ``sock`` is no longer usable afterwards either way
    (the caller closes it).
    """
    sock.settimeout(timeout_s)
    wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    completed = False
    try:
        wrapped.do_handshake()
        completed = True
    finally:
        if not completed:
            wrapped.close()
    return wrapped


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
