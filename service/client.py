"""The web tier's client for the AppStats service: pooled connections, deadlines, trace context.

Each call waits at most its deadline (``deadline_ms``, default ``timeout_ms``)
for a pooled connection, sends the remaining budget as ``meta.deadline_ms``,
and reads the reply with a socket timeout of that budget plus a small margin,
so no call waits forever. The caller's OpenTelemetry context travels in
``meta.headers`` (W3C ``traceparent``, ``tracestate``, ``baggage``), injected
from inside a CLIENT span, so the server's spans join the caller's trace.

What a call raises::

    appstats.InvalidRequest   the request is malformed; do not retry it unchanged
    appstats.Overloaded       the server is shedding load; retry after retry_after_ms
    appstats.PanelFailed      a required panel failed
    TApplicationException     the server could not run the call (INTERNAL_ERROR, ...)
    TTransportException       the connection failed, or the call timed out (type TIMED_OUT);
                              every AppStats method only reads, so a retry is safe

A connection whose call ended in a transport error or timeout is closed, never
reused: a late reply must not be read as the answer to the next call. A pooled
connection idle for ``max_idle_ms`` (50 s, under the server's 60 s
``server.idle_timeout_ms``) is closed instead of reused. A call that fails at
the transport level (not a timeout) is tried once more on a new connection,
within its deadline: every AppStats method only reads.

Overload: a ``get_app_stats`` answered ``Overloaded`` is tried again after the
server's ``retry_after_ms``, jittered (x0.5 to x1.5), if the call's deadline
leaves time for it and the client's :class:`~lookups.resilience.budget.RetryBudget`
allows: retries stay within ``overload_retry_ratio`` (10%) of calls, plus a
small reserve, so overload never turns into a retry storm. Otherwise, or after
``MAX_OVERLOAD_ATTEMPTS``, the ``Overloaded`` is raised.

TLS: pass ``tls_ca_file`` (PEM CAs to trust) and, when the certificate does not
name the host you connect to, ``tls_server_hostname``. The server is always
verified; a failed handshake raises TTransportException(NOT_OPEN) saying why.
"""

from __future__ import annotations

import random
import socket as _socket
import ssl
import time
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence

import gevent
import gevent.lock
from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider
from thriftpy2.protocol import TCompactProtocol, TCyBinaryProtocol
from thriftpy2.thrift import TApplicationException, TClient
from thriftpy2.transport import TCyBufferedTransport, TCyFramedTransport, TSocket, TTransportException

from lookups.resilience.budget import RetryBudget
from service.engine.deadline import Deadline
from service.idl import appstats
from service.wire.tls import client_context
from tracing.propagation import inject_headers

__all__ = ["AppStatsClient", "REPLY_MARGIN_MS", "MAX_OVERLOAD_ATTEMPTS"]

#: Extra time the client waits beyond the deadline it sends: the server answers
#: at its deadline, and the reply still has to arrive.
REPLY_MARGIN_MS = 250

#: Attempts of one call answered Overloaded, the first included.
MAX_OVERLOAD_ATTEMPTS = 3
# The least a retried call should still have before its deadline, besides the back-off.
_MIN_RETRY_BUDGET_MS = 50

_TRANSPORTS = {"framed": TCyFramedTransport, "buffered": TCyBufferedTransport}
_PROTOCOLS = {"binary": TCyBinaryProtocol, "compact": TCompactProtocol}
# Errors that arrive as a complete reply: the connection is still in step.
_REPLY_ERRORS = (TApplicationException, appstats.InvalidRequest, appstats.Overloaded,
                 appstats.PanelFailed)


class _Connection:
    """One open socket and the thriftpy2 client speaking over it."""

    __slots__ = ("socket", "client", "idle_since")

    def __init__(self, socket: TSocket, client: TClient) -> None:
        self.socket = socket
        self.client = client
        self.idle_since = time.monotonic()

    def set_timeout_ms(self, timeout_ms: float) -> None:
        self.socket.set_timeout(max(1.0, timeout_ms))

    def close(self) -> None:
        self.socket.close()


class _TlsSocket(TSocket):
    """A client TSocket that verifies the server against ``context`` and ``server_hostname``."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, server_hostname: str,
                 socket_timeout: float, connect_timeout: float) -> None:
        super().__init__(host, port, socket_timeout=socket_timeout, connect_timeout=connect_timeout)
        self._context = context
        self._server_hostname = server_hostname

    def open(self) -> None:
        """Connect and complete the handshake within the connect timeout.

        Raises TTransportException(NOT_OPEN) with the reason on failure.
        """
        try:
            raw = _socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise TTransportException(TTransportException.NOT_OPEN,
                                      f"Could not connect to {self.host}:{self.port}: {exc}") from None
        try:
            raw.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            self.sock = self._context.wrap_socket(raw, server_hostname=self._server_hostname)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise TTransportException(TTransportException.NOT_OPEN,
                                      f"TLS handshake with {self.host}:{self.port} failed: "
                                      f"{getattr(exc, 'reason', None) or exc}") from None
        self.sock.settimeout(self.socket_timeout)


class _ConnectionPool:
    """At most ``size`` open connections; idle ones are reused, broken ones closed."""

    def __init__(self, connect: Callable[[Deadline], _Connection], size: int,
                 max_idle_s: float) -> None:
        self._connect = connect
        self._max_idle_s = max_idle_s
        self._slots = gevent.lock.BoundedSemaphore(size)
        self._idle: list[_Connection] = []
        self._closed = False

    @contextmanager
    def connection(self, deadline: Deadline, fresh: bool = False) -> Iterator[_Connection]:
        """Lend a connection for one call (a new one if ``fresh``); raises
        TTransportException(TIMED_OUT) if none frees up before ``deadline``, or
        TTransportException(NOT_OPEN) when closed."""
        if self._closed:
            raise TTransportException(TTransportException.NOT_OPEN, "client is closed")
        if not self._slots.acquire(timeout=deadline.remaining_s()):
            raise TTransportException(TTransportException.TIMED_OUT,
                                      "no pooled connection became free before the deadline")
        connection: Optional[_Connection] = None
        in_step = False
        try:
            connection = (None if fresh else self._reusable()) or self._connect(deadline)
            yield connection
            in_step = True
        except _REPLY_ERRORS:
            in_step = True
            raise
        finally:
            if connection is not None:
                if in_step and not self._closed:
                    connection.idle_since = time.monotonic()
                    self._idle.append(connection)
                else:
                    connection.close()
            self._slots.release()

    def _reusable(self) -> Optional[_Connection]:
        """The most recently used idle connection that is not too old; older ones are closed."""
        while self._idle:
            connection = self._idle.pop()
            if time.monotonic() - connection.idle_since < self._max_idle_s:
                return connection
            connection.close()  # the server may be closing it right now: do not race it
        return None

    def close(self) -> None:
        """Close idle connections now; connections in use close when returned."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class AppStatsClient:
    """A pooled, deadline-bound, traced client for the AppStats service.

    ``transport`` ("framed" or "buffered") and ``protocol`` ("binary" or
    "compact") must match the server's; raises ValueError for other values or
    for a non-positive pool size or timeout. ``tracer_provider`` defaults to
    the global one. ``tls_ca_file`` turns TLS on (see the module doc); raises
    :class:`service.wire.tls.TlsConfigError` when it cannot be read.
    """

    def __init__(self, host: str, port: int, *, transport: str = "framed", protocol: str = "binary",
                 pool_size: int = 8, connect_timeout_ms: int = 1000, timeout_ms: int = 3000,
                 tracer_provider: Optional[TracerProvider] = None,
                 tls_ca_file: Optional[str] = None,
                 tls_server_hostname: Optional[str] = None,
                 overload_retry_ratio: float = 0.1, max_idle_ms: int = 50_000) -> None:
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}")
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(_PROTOCOLS)}, got {protocol!r}")
        if min(pool_size, connect_timeout_ms, timeout_ms) < 1:
            raise ValueError("pool_size, connect_timeout_ms and timeout_ms must be at least 1")
        self._host, self._port = host, port
        self._make_transport = _TRANSPORTS[transport]
        self._make_protocol = _PROTOCOLS[protocol]
        self._connect_timeout_ms = connect_timeout_ms
        self._timeout_ms = timeout_ms
        self._tls = client_context(tls_ca_file) if tls_ca_file else None
        self._tls_server_hostname = tls_server_hostname or host
        self._pool = _ConnectionPool(self._connect, pool_size, max_idle_ms / 1000.0)
        # Ratio 0 turns retries off altogether, reserve included.
        self.retry_budget = RetryBudget(overload_retry_ratio, reserve=3.0 if overload_retry_ratio else 0.0)
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        self._span_attributes = {"rpc.system": "apache_thrift", "rpc.service": "AppStats",
                                 "server.address": host, "server.port": port}

    def ping(self) -> str:
        """The server's liveness answer. Raises as described in the module doc."""
        return self._call("ping", self._timeout_ms, lambda remaining_ms: ())

    def health(self) -> Any:
        """The server's ``appstats.Health``: serving state and each backend's status.

        Raises as described in the module doc.
        """
        return self._call("health", self._timeout_ms, lambda remaining_ms: ())

    def pool_stats(self) -> Any:
        """The server's ``appstats.PoolReport``: each pool's use and recommended size."""
        return self._call("pool_stats", self._timeout_ms, lambda remaining_ms: ())

    def panels(self) -> list[str]:
        """Names of the panels the server can gather. Raises as described in the module doc."""
        return self._call("panels", self._timeout_ms, lambda remaining_ms: ())

    def get_app_stats(self, app: str, start_ms: int, end_ms: int,
                      panels: Optional[Sequence[str]] = None, *, deadline_ms: Optional[int] = None,
                      request_id: Optional[str] = None) -> Any:
        """``app``'s panels over ``[start_ms, end_ms)`` as an ``appstats.StatsResponse``.

        ``panels`` defaults to every panel the server offers; ``deadline_ms``
        (default ``timeout_ms``) bounds the whole call, here and on the server.
        Raises as described in the module doc.
        """
        def build_args(remaining_ms: int) -> tuple[Any, ...]:
            meta = appstats.RequestMeta(headers=inject_headers(), deadline_ms=remaining_ms,
                                        request_id=request_id)
            request = appstats.StatsRequest(app=app, start_ms=start_ms, end_ms=end_ms,
                                            panels=None if panels is None else list(panels),
                                            meta=meta)
            return (request,)

        deadline = Deadline.after_ms(self._timeout_ms if deadline_ms is None else deadline_ms)
        self.retry_budget.record_call()
        for attempt in range(1, MAX_OVERLOAD_ATTEMPTS + 1):
            try:
                return self._call("get_app_stats", int(deadline.remaining_ms()), build_args)
            except appstats.Overloaded as overloaded:
                if attempt == MAX_OVERLOAD_ATTEMPTS or not self._back_off(overloaded, deadline):
                    raise
        raise AssertionError("unreachable")

    def _back_off(self, overloaded: Any, deadline: Deadline) -> bool:
        """Sleep the jittered ``retry_after_ms`` if time and the retry budget allow; True if slept."""
        delay_ms = (overloaded.retry_after_ms or 0) * random.uniform(0.5, 1.5)
        if deadline.remaining_ms() < delay_ms + _MIN_RETRY_BUDGET_MS:
            return False
        if not self.retry_budget.try_retry():
            return False
        gevent.sleep(delay_ms / 1000.0)
        return True

    def close(self) -> None:
        """Close the pooled connections; later calls raise TTransportException(NOT_OPEN)."""
        self._pool.close()

    def __enter__(self) -> "AppStatsClient":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        self.close()

    def _call(self, method: str, deadline_ms: int,
              build_args: Callable[[int], tuple[Any, ...]]) -> Any:
        deadline = Deadline.after_ms(deadline_ms)
        try:
            return self._call_once(method, deadline, deadline_ms, build_args, fresh=False)
        except TTransportException as failure:
            # Read-only methods: one more try on a new connection, if time is left. A pooled
            # connection the server has just closed (idle, draining) fails exactly like this.
            if failure.type == TTransportException.TIMED_OUT or deadline.remaining_ms() < 1:
                raise
            return self._call_once(method, deadline, deadline_ms, build_args, fresh=True)

    def _call_once(self, method: str, deadline: Deadline, deadline_ms: int,
                   build_args: Callable[[int], tuple[Any, ...]], fresh: bool) -> Any:
        attributes = {**self._span_attributes, "rpc.method": method}
        with self._tracer.start_as_current_span(f"AppStats/{method}", kind=SpanKind.CLIENT,
                                                attributes=attributes):
            with self._pool.connection(deadline, fresh) as connection:
                remaining_ms = int(deadline.remaining_ms())
                if remaining_ms <= 0:
                    raise TTransportException(TTransportException.TIMED_OUT,
                                              f"{method}: deadline passed before sending")
                connection.set_timeout_ms(remaining_ms + REPLY_MARGIN_MS)
                args = build_args(remaining_ms)
                try:
                    return getattr(connection.client, method)(*args)
                except TimeoutError as exc:
                    raise TTransportException(TTransportException.TIMED_OUT,
                                              f"{method}: no reply within {deadline_ms} ms") from exc
                except OSError as exc:
                    raise TTransportException(TTransportException.UNKNOWN,
                                              f"{method}: {exc}") from exc

    def _connect(self, deadline: Deadline) -> _Connection:
        connect_timeout_ms = min(self._connect_timeout_ms, deadline.remaining_ms())
        if connect_timeout_ms < 1:
            raise TTransportException(TTransportException.TIMED_OUT,
                                      "deadline passed before connecting")
        socket: TSocket
        if self._tls is not None:
            socket = _TlsSocket(self._host, self._port, self._tls, self._tls_server_hostname,
                                socket_timeout=self._timeout_ms, connect_timeout=connect_timeout_ms)
        else:
            socket = TSocket(self._host, self._port, socket_timeout=self._timeout_ms,
                             connect_timeout=connect_timeout_ms)
        transport = self._make_transport(socket)
        transport.open()  # raises TTransportException(NOT_OPEN) on failure
        return _Connection(socket, TClient(appstats.AppStats, self._make_protocol(transport)))
