"""A small HTTP server on a native OS thread, apart from the event loop that runs calls.

Probes and scrapes must answer when the calls' event loop is saturated: at 300
callers, 59 of 61 one-second Prometheus scrapes served from that loop timed
out. gevent's monkey-patching turns ``threading.Thread`` into a greenlet, so the
thread here is started with the original ``_thread.start_new_thread``; it runs
a gevent hub of its own (gevent gives each native thread one) with a pywsgi
server on it. Python's GIL is handed over every few milliseconds
(``sys.getswitchinterval()``), so the thread answers within tens of
milliseconds while the main thread computes, where the loop's own server waits
for every block the loop computes.

An app served here runs on that thread: it may read plain attributes the main
thread writes, but must not touch the main hub's greenlets, locks or sockets;
:func:`call_on_main_loop` hands work to the main loop and waits for it, bounded.
"""

from __future__ import annotations

import logging
import socket as _socket_module
from collections.abc import Callable
from typing import Any

import gevent
import gevent.socket
from gevent import monkey
from gevent.pywsgi import WSGIServer

from service.operations.ports import cannot_listen

__all__ = ["NativeHttpServer", "call_on_main_loop", "native_lock"]

log = logging.getLogger(__name__)

_start_thread = monkey.get_original("_thread", "start_new_thread")
native_lock = monkey.get_original("_thread", "allocate_lock")
_NativeSocket = monkey.get_original("socket", "socket")


class NativeHttpServer:
    """Serve a WSGI ``app`` on ``(host, port)`` from a thread of its own.

    :meth:`start` binds in the caller's thread, so a port that cannot be bound
    raises OSError there, at start-up; :meth:`stop` ends the thread.
    """

    def __init__(self, host: str, port: int, app: Callable[..., Any], name: str) -> None:
        self._host, self._port, self._app, self.name = host, port, app, name
        self._address: tuple[str, int] | None = None
        self._server: WSGIServer | None = None
        self._loop: Any = None
        self._started = native_lock()
        self._ended = native_lock()

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "not started"
        return self._address

    def start(self) -> NativeHttpServer:
        family = _socket_module.AF_INET6 if ":" in self._host else _socket_module.AF_INET
        listener = _NativeSocket(family, _socket_module.SOCK_STREAM)
        try:
            listener.setsockopt(_socket_module.SOL_SOCKET, _socket_module.SO_REUSEADDR, 1)
            listener.bind((self._host, self._port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise cannot_listen(self._host, self._port, exc) from exc
        self._address = listener.getsockname()[:2]
        self._started.acquire()
        self._ended.acquire()
        _start_thread(self._serve, (listener.detach(), family))
        self._started.acquire()  # released once the thread's server accepts
        self._started.release()
        return self

    def _serve(self, fd: int, family: int) -> None:
        try:
            # Made on this thread, so its watchers belong to this thread's hub.
            listener = gevent.socket.socket(family, _socket_module.SOCK_STREAM, fileno=fd)
            self._loop = gevent.get_hub().loop
            self._server = WSGIServer(listener, self._app, log=None, error_log=None)
            self._server.start()
            self._started.release()
            self._server.serve_forever()
        except BaseException:  # a thread's end must be logged, not lost
            log.exception("%s: the server thread failed", self.name)
        finally:
            if self._started.locked():
                self._started.release()
            self._ended.release()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop serving and end the thread, waiting up to ``timeout_s``; idempotent."""
        server, self._server = self._server, None
        if server is None or self._loop is None:
            return
        self._loop.run_callback_threadsafe(gevent.spawn, server.stop, timeout_s)
        if self._ended.acquire(timeout=timeout_s + 1.0):
            self._ended.release()
        else:
            log.warning("%s: the server thread did not end within %.1f s", self.name, timeout_s + 1)


def call_on_main_loop(loop: Any, function: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """From a native thread: run ``function`` in a greenlet of ``loop``'s hub and wait.

    Returns ``(True, result)``, or ``(False, None)`` when it did not finish within
    ``timeout_s`` (it still runs to its end) or raised (logged).
    """
    done = native_lock()
    done.acquire()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(function())
        except Exception:  # reported to the waiting thread as a failure
            log.exception("a call from a native thread failed")
        finally:
            done.release()

    loop.run_callback_threadsafe(gevent.spawn, run)
    if not done.acquire(timeout=timeout_s):
        return False, None
    return bool(outcome), (outcome[0] if outcome else None)
