"""An HTTP service's health check: one GET on a connection kept open between checks.

A server checks each backend every couple of seconds, called or not, so on an idle
server the checks are most of what it does. Through requests each check cost about as
much CPU as a lookup's exchange: a session's hooks, adapters, cookie and header
handling, urllib3's pool, and (its body unread) a new connection each time. The idle
figures in ``docs/performance/idle.json`` are what moved this check to the standard
library's ``http.client``: one GET on one connection, the status line and a small body
read so that the next check reuses it.

The request is what the session's own would be: the same URL (``url`` or ``url`` +
``health_path``), the ``Authorization`` header when set, the backend's TLS files
(:mod:`lookups.backends.tls`), no proxy from the environment, no redirect followed.
A connection the service closed between checks (its keep-alive timeout) is opened
again once, within the same check.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from lookups.backends.tls import HttpsFiles

__all__ = ["HttpCheck", "KEPT_BODY_BYTES"]

#: A body at most this long is read, and the connection kept for the next check; a
#: longer or unsized one is left unread and its connection closed.
KEPT_BODY_BYTES = 64 * 1024
_USER_AGENT = "fanout-health-check"


class HttpCheck:
    """``GET url`` on a kept connection; :meth:`status` answers the status code.

    Not for concurrent use: the health checker runs one check of a backend at a time.
    """

    def __init__(self, url: str, https: HttpsFiles, authorization: str | None = None) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or ""
        self._port = parts.port
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = {"Host": parts.netloc.rpartition("@")[2], "User-Agent": _USER_AGENT}
        if authorization:
            self._headers["Authorization"] = authorization
        self._context = https.client_context() if parts.scheme == "https" else None
        self._connection: http.client.HTTPConnection | None = None

    def status(self, timeout_s: float) -> int:
        """The answer's status code; raises OSError or ``http.client.HTTPException`` when
        there is none. Each socket operation waits ``timeout_s`` at most; the caller
        bounds the whole exchange."""
        kept = self._connection
        if kept is not None:
            try:
                return self._exchange(kept, timeout_s)
            except (ConnectionError, http.client.BadStatusLine):
                pass  # the service closed it while it sat unused: once more, afresh
        return self._exchange(self._open(timeout_s), timeout_s)

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _open(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._context is not None:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout_s, context=self._context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _exchange(self, connection: http.client.HTTPConnection, timeout_s: float) -> int:
        self._connection = None  # kept again only once this exchange has ended cleanly
        try:
            connection.timeout = timeout_s
            if connection.sock is not None:
                connection.sock.settimeout(timeout_s)
            connection.request("GET", self._target, headers=self._headers)
            response = connection.getresponse()
            length = response.length
            if response.will_close or length is None or length > KEPT_BODY_BYTES:
                connection.close()
                return response.status
            response.read()
        except BaseException:  # a timer's too: a half-done exchange leaves nothing to reuse
            connection.close()
            raise
        self._connection = connection
        return response.status
