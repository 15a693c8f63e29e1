"""TLS for the Thrift listener and its clients: TLS 1.2 or later, mutual when asked.

The server's context comes from ``server.tls_cert_file`` and ``server.tls_key_file``
(PEM; the certificate file may hold the chain). With ``server.tls_client_ca_file``
it requires a client certificate signed by a CA in that file, and with
``server.tls_client_names`` the certificate must also name one of those
identities (:func:`peer_names`: its DNS and URI subject alternative names, so a
SPIFFE ID works). Clients verify the server against a CA file and a host name;
there is no option to skip verification. They may present a certificate of
their own. :mod:`service.wire.certificates` rebuilds the server's context when
its files change.

The server performs the handshake itself, on the accepted socket, under one
deadline for the whole handshake (see :func:`handshake`), so a peer that connects
and sends nothing, or sends a byte at a time, holds its connection slot for at
most that long.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterable
from typing import Any

import gevent
import gevent.ssl

from service.errors import ConfigError

__all__ = [
    "TlsConfigError",
    "server_context",
    "client_context",
    "handshake",
    "peer_names",
    "client_identity",
    "refusal_reason",
    "MINIMUM_VERSION",
    "ClosedBeforeHandshake",
]

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TlsConfigError(ConfigError):
    """The certificate, key or CA file cannot be read or does not fit; raised at start-up."""


def server_context(
    cert_file: str, key_file: str, client_ca_file: str = ""
) -> ssl.SSLContext | None:
    """The listener's context from ``server.tls_cert_file``, ``tls_key_file`` and
    ``tls_client_ca_file`` (mutual TLS when set), or ``None`` when ``cert_file`` is empty.

    Raises :class:`TlsConfigError` naming the key when a file cannot be loaded.
    """
    if not cert_file:
        return None
    # gevent's context wraps gevent sockets cooperatively whether or not ssl is patched.
    context: ssl.SSLContext = gevent.ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    _load_chain(context, "server.tls_cert_file / server.tls_key_file", cert_file, key_file)
    if client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        _load_cas(context, "server.tls_client_ca_file", client_ca_file)
    return context


def client_context(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A verifying client context trusting the CAs in ``ca_file`` (PEM), presenting the
    certificate in ``cert_file`` (and ``key_file``; the key may be in ``cert_file``) when given.

    Raises :class:`TlsConfigError` when a file cannot be loaded.
    """
    # Looked up at call time so a gevent-patched process gets gevent's context.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = MINIMUM_VERSION
    _load_cas(context, "CA file", ca_file)
    if cert_file:
        _load_chain(context, "client certificate", cert_file, key_file or None)
    elif key_file:
        raise TlsConfigError("a client key without a client certificate")
    return context


def peer_names(sock: ssl.SSLSocket) -> tuple[str, ...]:
    """The DNS and URI subject alternative names of the verified peer certificate."""
    certificate = sock.getpeercert() or {}
    names: tuple[tuple[str, str], ...] = certificate.get("subjectAltName", ())  # type: ignore[assignment]  # typeshed's union also covers other fields
    return tuple(value for kind, value in names if kind in ("DNS", "URI"))


def client_identity(sock: Any, allowed: Iterable[str] = ()) -> str:
    """Who a mutual-TLS client is, for fair share: the first of its certificate's names that
    ``allowed`` holds (``tls.allowed_clients``), else its first name; "" for a connection
    without a client certificate (plain, or TLS without one)."""
    if not hasattr(sock, "getpeercert"):
        return ""
    try:
        names = peer_names(sock)
    except (ValueError, OSError):  # not connected any more, or no handshake done
        return ""
    wanted = set(allowed)
    return next((name for name in names if name in wanted), names[0] if names else "")


def refusal_reason(exc: BaseException) -> str:
    """What a failed server-side handshake says of the peer, as a metric label."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    reason = getattr(exc, "reason", None) or ""
    if reason in _NO_CERTIFICATE:
        return "no_certificate"
    if reason == "CERTIFICATE_VERIFY_FAILED":
        return "untrusted_certificate"
    return "handshake_failed"  # not TLS, no common version or cipher, a bad alert


_NO_CERTIFICATE = frozenset(
    {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED"}
)


def _load_chain(context: ssl.SSLContext, what: str, cert_file: str, key_file: str | None) -> None:
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"{what}: cannot load {cert_file}"
            + (f" with {key_file}" if key_file else "")
            + f": {_reason(exc)}"
        ) from None


def _load_cas(context: ssl.SSLContext, what: str, ca_file: str) -> None:
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"{what}: cannot load CA file {ca_file}: {_reason(exc)}") from None


def handshake(context: ssl.SSLContext, sock: socket.socket, timeout_s: float) -> ssl.SSLSocket:
    """Wrap an accepted ``sock`` and complete the server side of the handshake.

    The whole handshake, from the first byte, has ``timeout_s``, whatever the pace
    of the peer's bytes (a socket timeout alone starts again at every byte, so a
    peer sending one byte a second could hold its connection for as long as it
    liked). Raises ``TimeoutError`` when the peer does not finish within it,
    ``ssl.SSLError`` when it does not speak TLS or fails the handshake,
    :class:`ClosedBeforeHandshake` when it closes without sending a byte (a TCP
    health check), ``OSError`` when the connection breaks. ``sock`` is no longer
    usable afterwards either way (the caller closes it).
    """
    deadline = gevent.Timeout(
        timeout_s, TimeoutError(f"TLS handshake not complete within {timeout_s * 1000:.0f} ms")
    )
    deadline.start()
    try:
        sock.settimeout(timeout_s)
        if not sock.recv(1, socket.MSG_PEEK):
            raise ClosedBeforeHandshake("the peer closed before the TLS handshake")
        wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        completed = False
        try:
            wrapped.do_handshake()
            completed = True
        finally:
            if not completed:
                wrapped.close()
        return wrapped
    finally:
        deadline.close()


class ClosedBeforeHandshake(ConnectionAbortedError):
    """The peer connected and closed without a byte: a TCP check, not a refused handshake."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
