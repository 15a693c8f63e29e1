"""HTTPS to the HTTP services: a private CA to trust, a client certificate to present.

An HTTP backend's ``ca_file`` (``[backends.<name>]``, or ``http.ca_file``) replaces
the system's trusted CAs for its lookups' session and its health check's (a
service behind a private CA); its ``client_cert_file`` and ``client_key_file`` are
presented to a service that asks for a client certificate. Verification is never turned off.
MongoDB's TLS is set in
``mongo.uri`` (``tls=true&tlsCAFile=...``), where pymongo reads it.

The files are loaded once here, at start-up, so a missing or mismatched file is a
configuration error naming its key rather than a failure of every lookup;
requests then loads them again for each new connection.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import requests

from lookups.backends.settings import HttpBackendSettings

__all__ = ["HttpsFiles", "load_https_files"]


@dataclass(frozen=True)
class HttpsFiles:
    """What a ``requests.Session`` is given: ``verify`` (the CA file, or ``True`` for the
    system's CAs) and ``cert`` (the client certificate and key, if any)."""

    verify: str | bool = True
    cert: str | tuple[str, str] | None = None

    def apply(self, session: requests.Session) -> None:
        session.verify = self.verify
        session.cert = self.cert

    def client_context(self) -> ssl.SSLContext:
        """The context requests builds from the same files, for a client that is not a
        session (the health check): the CA file or the system's CAs, the client
        certificate if any, the host name checked."""
        context = ssl.create_default_context(
            cafile=self.verify if isinstance(self.verify, str) else None
        )
        if isinstance(self.cert, tuple):
            context.load_cert_chain(*self.cert)
        elif self.cert:
            context.load_cert_chain(self.cert)
        return context


def load_https_files(settings: HttpBackendSettings) -> HttpsFiles:
    """Check that the backend's ``ca_file`` and client certificate load; what sessions use.

    Raises :class:`ValueError` naming the key (relative to the backend's table) when one
    does not.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    verify: str | bool = True
    cert: str | tuple[str, str] | None = None
    if settings.ca_file:
        try:
            context.load_verify_locations(cafile=settings.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ca_file: cannot load {settings.ca_file}: {_reason(exc)}") from None
        verify = settings.ca_file
    if settings.client_cert_file:
        try:
            context.load_cert_chain(settings.client_cert_file, settings.client_key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"client_cert_file: cannot load {settings.client_cert_file}: {_reason(exc)}"
            ) from None
        cert = (
            (settings.client_cert_file, settings.client_key_file)
            if settings.client_key_file
            else settings.client_cert_file
        )
    return HttpsFiles(verify, cert)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
