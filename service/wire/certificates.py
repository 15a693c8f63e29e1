"""The listener's TLS context, rebuilt when its certificate, key or CA files change.

Kubernetes rotates the files of a mounted secret (cert-manager renewing a
certificate, an operator replacing a CA) by writing a new directory and renaming
a symlink, ``..data``, over the old one; each file's path is a symlink through
it. :class:`RotatingContext` stats the files, through the symlinks, at most once
per ``check_every_s`` as connections arrive, and builds a new context when any
changed: new connections get it, connections already open keep theirs (an
``SSLSocket`` holds its own). Files that do not load together (a key that does
not match the certificate, a file half written) keep the old context; that is
one ERROR per change seen, and the next change is tried again.

Why stat on accept rather than inotify or a watcher greenlet: three ``stat``
calls once a second cost microseconds, need no library and no greenlet to stop,
follow symlink swaps on every filesystem, and a listener nobody connects to
needs no new context. A connection within ``check_every_s`` of a rotation may
still get the previous certificate, which is as valid as it was a second before.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Sequence

from lookups.clock import SYSTEM_CLOCK, Clock
from service.wire.tls import TlsConfigError

__all__ = ["RotatingContext", "CHECK_EVERY_S", "expires_at"]

log = logging.getLogger(__name__)

#: How often, at most, the files are looked at again.
CHECK_EVERY_S = 1.0

_Signature = tuple[tuple[int, int, int, int] | None, ...]


class RotatingContext:
    """The current context for ``paths``, built by ``build`` (which raises
    :class:`~service.wire.tls.TlsConfigError` for files it cannot load).

    The first build happens here, so unusable files stop start-up.
    """

    def __init__(
        self,
        build: Callable[[], ssl.SSLContext],
        paths: Sequence[str],
        check_every_s: float = CHECK_EVERY_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._build = build
        self._paths = tuple(paths)
        self._check_every_s = check_every_s
        self._clock = clock
        self._seen = _signature(self._paths)
        self._context = build()
        self._checked = clock.monotonic()
        self.reloads = 0  # new contexts in use since start
        self.failed_reloads = 0  # changes whose files did not load

    def current(self) -> ssl.SSLContext:
        """The context for a new connection, rebuilt first if the files changed."""
        now = self._clock.monotonic()
        if now - self._checked >= self._check_every_s:
            self._checked = now
            self._reload_if_changed()
        return self._context

    def _reload_if_changed(self) -> None:
        signature = _signature(self._paths)
        if signature == self._seen:
            return
        self._seen = signature  # tried once per change: a bad file is not retried every second
        try:
            context = self._build()
        except TlsConfigError as exc:
            self.failed_reloads += 1
            log.error(
                "TLS: the changed certificate files do not load; new connections keep "
                "the previous ones: %s",
                exc,
            )
            return
        self._context = context
        self.reloads += 1
        log.info("TLS: certificate files changed; new connections use them")


def _signature(paths: Sequence[str]) -> _Signature:
    """What identifies each file's content without reading it; ``None`` for a missing file."""
    signature: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            stat = os.stat(path)  # follows the symlinks a secret volume swaps
        except OSError:
            signature.append(None)
            continue
        signature.append((stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


def expires_at(path: str) -> float | None:
    """When the first of the certificates in PEM file ``path`` expires (Unix time): for a
    chain, the soonest of its certificates; None when the file holds none that can be read.

    ``ssl`` decodes only a peer's certificate and CA certificates, never a server's own,
    hence the ``cryptography`` library, imported here: a server without TLS never loads it.
    """
    from cryptography import x509

    try:
        with open(path, "rb") as pem:
            certificates = x509.load_pem_x509_certificates(pem.read())
    except (OSError, ValueError):
        return None
    return min(certificate.not_valid_after_utc.timestamp() for certificate in certificates)
