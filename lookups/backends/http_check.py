"""An HTTP service's health check: one GET on a connection kept open between checks.

A server checks each backend every couple of seconds, called or not, so on an idle
server the checks are most of what it does. Through requests each check cost about as
much CPU as a lookup's exchange: a session's hooks, adapters, cookie and header
handling, urllib3's pool, and (its body unread) a new connection each time. The idle
figures in ``docs/performance/idle.json`` moved this check first to the standard
library's ``http.client``, and then off it: its request building and its header parsing
(``email.parser``) still cost each check more than the MongoDB backend's ping
through pymongo. A check needs one fixed request and, of the answer, its status line and
whether its body can be read to keep the connection; so it is written here: the request
is built once, the answer's head read into one buffer and split by lines.

The request is what the session's own would be: the same URL (``url`` or ``url`` +
``health_path``), the ``Authorization`` header when set, the backend's TLS files
(:mod:`lookups.backends.tls`), no proxy from the environment, no redirect followed.
A connection the service closed between checks (its keep-alive timeout) is opened
again once, within the same check. The connection is kept only for an HTTP/1.1 answer
that does not say ``Connection: close``, with a ``Content-Length`` of at most
:data:`KEPT_BODY_BYTES` (its body read) and no ``Transfer-Encoding``; any other is closed
with its body unread.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from lookups.backends.tls import HttpsFiles

__all__ = ["HttpCheck", "KEPT_BODY_BYTES", "NotAnHttpAnswer"]

#: A body at most this long is read, and the connection kept for the next check; a
#: longer or unsized one is left unread and its connection closed.
KEPT_BODY_BYTES = 64 * 1024
#: An answer's status line and headers may be this long at most.
MAX_HEAD_BYTES = 16 * 1024
_USER_AGENT = "fanout-health-check"


class NotAnHttpAnswer(ValueError):
    """What answered is not HTTP/1.x: no status line, or a head longer than allowed."""


class HttpCheck:
    """``GET url`` on a kept connection; :meth:`status` answers the status code.

    Not for concurrent use: the health checker runs one check of a backend at a time.
    """

    def __init__(self, url: str, https: HttpsFiles, authorization: str | None = None) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or ""
        secure = parts.scheme == "https"
        self._address = (self._host, parts.port or (443 if secure else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [
            f"GET {target} HTTP/1.1",
            f"Host: {parts.netloc.rpartition('@')[2]}",
            f"User-Agent: {_USER_AGENT}",
            "Accept: */*",
        ]
        if authorization:
            lines.append(f"Authorization: {authorization}")
        self._request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._context = https.client_context() if secure else None
        self._connection: socket.socket | None = None

    def status(self, timeout_s: float) -> int:
        """The answer's status code; raises OSError or :class:`NotAnHttpAnswer` when there
        is none. Each socket operation waits ``timeout_s`` at most; the caller bounds the
        whole exchange."""
        kept = self._connection
        if kept is not None:
            try:
                return self._exchange(kept, timeout_s)
            except ConnectionError:
                pass  # the service closed it while it sat unused: once more, afresh
        return self._exchange(self._open(timeout_s), timeout_s)

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _open(self, timeout_s: float) -> socket.socket:
        connection = socket.create_connection(self._address, timeout=timeout_s)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                return self._context.wrap_socket(connection, server_hostname=self._host)
        except BaseException:
            connection.close()
            raise
        return connection

    def _exchange(self, connection: socket.socket, timeout_s: float) -> int:
        self._connection = None  # kept again only once this exchange has ended cleanly
        try:
            connection.settimeout(timeout_s)
            connection.sendall(self._request)
            status, keep = _read_answer(connection)
        except BaseException:  # a timer's too: a half-done exchange leaves nothing to reuse
            connection.close()
            raise
        if keep:
            self._connection = connection
        else:
            connection.close()
        return status


def _read_answer(connection: socket.socket) -> tuple[int, bool]:
    """The status code of the answer on ``connection``, and whether the connection can be
    kept (then its body has been read)."""
    buffer = bytearray()
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise NotAnHttpAnswer(f"no end of the head within {MAX_HEAD_BYTES} bytes")
        chunk = connection.recv(65536)
        if not chunk:
            if buffer:
                raise NotAnHttpAnswer("the connection closed within the head")
            raise ConnectionResetError("the connection closed before an answer")
        buffer += chunk
    lines = buffer[:end].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise NotAnHttpAnswer("no HTTP/1.x status line")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip().lower()
    length = fields.get("content-length", "")
    keep = (
        version == "HTTP/1.1"
        and "close" not in fields.get("connection", "")
        and "transfer-encoding" not in fields
        and length.isdigit()
        and int(length) <= KEPT_BODY_BYTES
    )
    if keep:
        keep = _read_body(connection, int(length) - (len(buffer) - end - 4))
    return int(code), keep


def _read_body(connection: socket.socket, missing: int) -> bool:
    """Read the ``missing`` bytes left of a body; False if more came than the body holds
    (the connection then carries something unknown and is not kept)."""
    while missing > 0:
        chunk = connection.recv(missing)
        if not chunk:
            return False
        missing -= len(chunk)
    return missing == 0
