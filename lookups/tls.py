"""HTTPS to the HTTP services: a private CA to trust, a client certificate to present.

An HTTP backend's ``ca_file`` (``http.ca_file`` for the built-in ones) replaces
the system's trusted CAs for its lookups' session and its health check's (a
service behind a private CA); its ``client_cert_file`` and ``client_key_file`` are
presented to a service that asks for a client certificate. Verification is never turned off. MongoDB's TLS is set in
``mongo.uri`` (``tls=true&tlsCAFile=...``), where pymongo reads it.

The files are loaded once here, at start-up, so a missing or mismatched file is a
configuration error naming its key rather than a failure of every lookup;
requests then loads them again for each new connection.
"""

from __future__ import annotations

import ssl

import requests

from lookups.backends.settings import HttpBackendSettings

__all__ = ["use_https_settings"]


def use_https_settings(session: requests.Session, settings: HttpBackendSettings) -> None:
    """Make ``session`` trust ``http.ca_file`` and present the client certificate, when set.

    Raises :class:`ValueError` naming the key when a file does not load.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if settings.ca_file:
        try:
            context.load_verify_locations(cafile=settings.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"http.ca_file: cannot load {settings.ca_file}: {_reason(exc)}") from None
        session.verify = settings.ca_file
    if settings.client_cert_file:
        try:
            context.load_cert_chain(settings.client_cert_file, settings.client_key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"http.client_cert_file: cannot load {settings.client_cert_file}: "
                             f"{_reason(exc)}") from None
        session.cert = ((settings.client_cert_file, settings.client_key_file)
                        if settings.client_key_file else settings.client_cert_file)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
