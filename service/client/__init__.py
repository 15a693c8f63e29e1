"""The web tier's client for the AppStats service: pooled connections, deadlines, trace context.

Each call waits at most its deadline (``deadline_ms``, default ``timeout_ms``) for a
pooled connection, sends the remaining budget as ``meta.deadline_ms``, and reads the
reply with a socket timeout of that budget plus a small margin, so no call waits
forever. The caller's OpenTelemetry context travels in ``meta.headers`` (W3C
``traceparent``, ``tracestate``, ``baggage``), injected inside a CLIENT span.

What a call raises::

    appstats.InvalidRequest   the request is malformed; do not retry it unchanged
    appstats.Overloaded       the server is shedding load; retry after retry_after_ms
    appstats.PanelFailed      a required panel failed
    TApplicationException     the server could not run the call (INTERNAL_ERROR, ...)
    TTransportException       the connection failed, or the call timed out (type TIMED_OUT);
                              every AppStats method only reads, so a retry is safe

Several instances: pass ``addresses=[(host, port), ...]``, or ``resolve=True`` to use
every address ``host`` resolves to (re-resolved every ``resolve_interval_ms``); calls go
to the less busy of two instances picked at random; an instance that refuses or resets new
connections, or is too slow
three times in a row, is left out for a while, and comes back once it answers a
``ping`` (:mod:`service.client.instances`). With several instances a
``get_app_stats`` whose first attempt is slower than the 99th percentile of
recent calls sends a backup attempt to another instance, within 5% of calls,
and takes whichever answers first (:mod:`service.client.hedging`): a hung
instance costs no call.

A connection whose call ended in a transport error or timeout is closed, never reused
(a late reply must not answer the next call), and so is one idle for ``max_idle_ms``
(50 s, under the server's 60 s ``server.idle_timeout_ms``). A call that fails at the
transport level (not a timeout) is tried once more, within its deadline, on another
instance or a new connection: every AppStats method only reads.

Overload: a ``get_app_stats`` answered ``Overloaded`` is tried again after the
server's ``retry_after_ms``, jittered (x0.5 to x1.5), if the call's deadline
leaves time for it and the client's :class:`~lookups.resilience.guard.RetryBudget`
allows: retries stay within ``overload_retry_ratio`` (10%) of calls, plus a
small reserve, so overload never turns into a retry storm. Otherwise, or after
``MAX_OVERLOAD_ATTEMPTS``, the ``Overloaded`` is raised.

TLS: ``tls_ca_file`` (PEM CAs to trust), ``tls_server_hostname`` when the certificate
names another host, and for mutual TLS ``tls_cert_file`` and ``tls_key_file``. The
server is always verified; a failed handshake, or a server refusing the certificate,
raises TTransportException. Under overload, a call's ``criticality`` says what the server
may shed first (the manual: docs/explanation/brownout.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, TracerProvider
from thriftpy2.transport import TTransportException

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.resilience.guard import RetryBudget
from service.client.connections import Connection, ConnectionPool, Connector
from service.client.hedging import BackupRequests, race_with_backup
from service.client.instances import Instance, Instances
from service.idl import appstats
from service.wire.formats import PROTOCOLS, TRANSPORTS
from service.wire.tls import client_context
from tracing.context import inject_headers
from tracing.spans import rpc_attributes

__all__ = ["AppStatsClient", "REPLY_MARGIN_MS", "OVERLOAD_RETRY_RATIO", "MAX_OVERLOAD_ATTEMPTS"]

#: Extra time the client waits beyond the deadline it sends (the reply must still arrive).
REPLY_MARGIN_MS = 250

#: The share of calls that may be tried again after an Overloaded (0: none).
OVERLOAD_RETRY_RATIO = 0.1
#: Attempts of one call answered Overloaded, the first included.
MAX_OVERLOAD_ATTEMPTS = 3
_MIN_RETRY_BUDGET_MS = 50  # the least a retried call should have left, besides the back-off


class AppStatsClient:
    """A pooled, deadline-bound, traced client for the AppStats service.

    ``transport`` ("framed" or "buffered") and ``protocol`` ("binary" or
    "compact") must match the server's; raises ValueError for other values or
    for a non-positive pool size or timeout. ``tracer_provider`` defaults to
    the global one. ``tls_ca_file`` turns TLS on (see the module doc); raises
    :class:`service.wire.tls.TlsConfigError` when it cannot be read. ``caller`` names
    who calls (``RequestMeta.caller``), for the server's fair share under overload.
    ``clock`` (the machine's unless given) times its deadlines, idle connections, the
    pauses ``Overloaded`` asks for, ejections and backup requests.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        transport: str = "framed",
        protocol: str = "binary",
        pool_size: int = 8,
        connect_timeout_ms: int = 1000,
        timeout_ms: int = 3000,
        tracer_provider: TracerProvider | None = None,
        tls_ca_file: str | None = None,
        tls_server_hostname: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        overload_retry_ratio: float = OVERLOAD_RETRY_RATIO,
        max_idle_ms: int = 50_000,
        addresses: Sequence[tuple[str, int]] | None = None,
        resolve: bool = False,
        resolve_interval_ms: int = 30_000,
        eject_ms: int = 5_000,
        peer_service: str = "fanout",
        backup_percentile: float = 0.99,
        backup_ratio: float = 0.05,
        caller: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if min(pool_size, connect_timeout_ms, timeout_ms) < 1:
            raise ValueError("pool_size, connect_timeout_ms and timeout_ms must be at least 1")
        self._timeout_ms = timeout_ms
        self._clock = clock
        self.caller = caller
        if (tls_cert_file or tls_key_file) and not tls_ca_file:
            raise ValueError("tls_cert_file and tls_key_file need tls_ca_file (TLS first)")
        tls = client_context(tls_ca_file, tls_cert_file, tls_key_file) if tls_ca_file else None

        def make_pool(address_host: str, address_port: int) -> ConnectionPool:
            connector = Connector(
                address_host,
                address_port,
                transport=transport,
                protocol=protocol,
                connect_timeout_ms=connect_timeout_ms,
                timeout_ms=timeout_ms,
                tls=tls,
                tls_server_hostname=tls_server_hostname or host,
            )
            return ConnectionPool(connector, pool_size, max_idle_ms / 1000.0, clock)

        options: dict[str, Any] = {
            "resolve_interval_s": resolve_interval_ms / 1000.0,
            "eject_s": eject_ms / 1000.0,
            "prober": self._answers_ping,
            "clock": clock,
        }
        #: Backup requests for get_app_stats (``backup_ratio`` 0: none).
        self.backups = BackupRequests(backup_percentile, backup_ratio)
        self._probe_timeout_ms = connect_timeout_ms + REPLY_MARGIN_MS
        self.instances = (
            Instances.from_name(host, port, make_pool, **options)
            if resolve
            else Instances(addresses or [(host, port)], make_pool, **options)
        )
        self.retry_budget = RetryBudget(overload_retry_ratio, clock=clock)  # 0: no retries at all
        self._tracer = trace.get_tracer("service.client", tracer_provider=tracer_provider)
        #: ``peer.service`` of the client's spans: what trace views name the server in their graphs.
        self.peer_service = peer_service

    def ping(self) -> str:
        """The server's liveness answer. Raises as described in the module doc."""
        result: str = self._call("ping", self._timeout_ms, lambda remaining_ms: ())
        return result

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
        result: list[str] = self._call("panels", self._timeout_ms, lambda remaining_ms: ())
        return result

    def panel_info(self) -> list[Any]:
        """The panels as ``appstats.PanelInfo``: name, source, whether optional or required."""
        result: list[Any] = self._call("panel_info", self._timeout_ms, lambda remaining_ms: ())
        return result

    def get_app_stats(
        self,
        app: str,
        start_ms: int,
        end_ms: int,
        panels: Sequence[str] | None = None,
        *,
        deadline_ms: int | None = None,
        request_id: str | None = None,
        criticality: str | None = None,
        fresh: bool = False,
    ) -> Any:
        """``app``'s panels over ``[start_ms, end_ms)`` as an ``appstats.StatsResponse``.

        ``panels`` defaults to every panel the server offers; ``deadline_ms`` (default
        ``timeout_ms``) bounds the whole call, here and on the server; ``criticality``
        (``"SHEDDABLE"``, ...; none: ``CRITICAL``) says what may be shed first under
        overload; ``fresh`` asks for an answer that reads no cached bucket. Raises as
        described in the module doc, and ``ValueError`` for an unknown criticality.
        """
        level = _criticality(criticality)

        def build_args(remaining_ms: int) -> tuple[Any, ...]:
            meta = appstats.RequestMeta(
                headers=inject_headers(),
                deadline_ms=remaining_ms,
                request_id=request_id,
                criticality=level,
                fresh=True if fresh else None,
                caller=self.caller,
            )
            request = appstats.StatsRequest(
                app=app,
                start_ms=start_ms,
                end_ms=end_ms,
                panels=None if panels is None else list(panels),
                meta=meta,
            )
            return (request,)

        deadline = Deadline.after_ms(
            self._timeout_ms if deadline_ms is None else deadline_ms, self._clock
        )
        self.retry_budget.record_call()
        self.backups.budget.record_call()
        for attempt in range(1, MAX_OVERLOAD_ATTEMPTS + 1):
            try:
                return self._call(
                    "get_app_stats", int(deadline.remaining_ms()), build_args, hedged=True
                )
            except appstats.Overloaded as overloaded:
                if attempt == MAX_OVERLOAD_ATTEMPTS or not self._back_off(overloaded, deadline):
                    raise
        raise AssertionError("unreachable")

    def _back_off(self, overloaded: Any, deadline: Deadline) -> bool:
        """Sleep the jittered ``retry_after_ms`` if time and the retry budget allow; True if
        slept."""
        delay_ms = (overloaded.retry_after_ms or 0) * random.uniform(0.5, 1.5)
        if deadline.remaining_ms() < delay_ms + _MIN_RETRY_BUDGET_MS:
            return False
        if not self.retry_budget.try_retry():
            return False
        deadline.clock.sleep(delay_ms / 1000.0)
        return True

    def close(self) -> None:
        """Close the pooled connections; later calls raise TTransportException(NOT_OPEN)."""
        self.instances.close()

    def __enter__(self) -> AppStatsClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _call(
        self,
        method: str,
        deadline_ms: int,
        build_args: Callable[[int], tuple[Any, ...]],
        hedged: bool = False,
    ) -> Any:
        deadline = Deadline.after_ms(deadline_ms, self._clock)
        delay_s = self.backups.delay_s() if hedged and len(self.instances.all) > 1 else None
        if delay_s is None or delay_s * 1000.0 >= deadline.remaining_ms():
            return self._call_retrying(
                self.instances.pick(), method, deadline, deadline_ms, build_args
            )
        return race_with_backup(self, method, deadline, deadline_ms, build_args, delay_s)

    def _call_retrying(
        self,
        instance: Instance,
        method: str,
        deadline: Deadline,
        deadline_ms: int,
        build_args: Callable[[int], tuple[Any, ...]],
        tried: list[Instance] | None = None,
    ) -> Any:
        """The call on ``instance``, tried once more on another after a transport failure;
        ``tried`` gets each instance used."""
        tried = [] if tried is None else tried
        tried.append(instance)
        try:
            return self._call_on(instance, method, deadline, deadline_ms, build_args, fresh=False)
        except TTransportException as failure:
            # Read-only methods: one more try, if time is left: on another instance, or on a
            # new connection. A pooled connection the server just closed fails like this too.
            if failure.type == TTransportException.TIMED_OUT or deadline.remaining_ms() < 1:
                raise
            other = self.instances.pick(exclude=tried)
            tried.append(other)
            return self._call_on(other, method, deadline, deadline_ms, build_args, fresh=True)

    def _answers_ping(self, instance: Instance) -> bool:
        """For :class:`Instances`: does ``instance`` answer a ping on a new connection?"""
        deadline = Deadline.after_ms(self._probe_timeout_ms, self._clock)
        try:
            result: bool = (
                self._call_on(
                    instance,
                    "ping",
                    deadline,
                    self._probe_timeout_ms,
                    lambda remaining_ms: (),
                    fresh=True,
                )
                == "pong"
            )
            return result
        except Exception:  # noqa: BLE001 - any failure means "not yet"
            return False

    def _call_on(
        self,
        instance: Instance,
        method: str,
        deadline: Deadline,
        deadline_ms: int,
        build_args: Callable[[int], tuple[Any, ...]],
        fresh: bool,
    ) -> Any:
        attributes: dict[str, Any] = {
            **rpc_attributes(method),
            "peer.service": self.peer_service,
            "server.address": instance.host,
            "server.port": instance.port,
        }
        instance.inflight += 1
        instance.calls += 1
        reused = exchanging = False
        started = self._clock.monotonic()
        try:
            with (
                self._tracer.start_as_current_span(
                    f"AppStats/{method}", kind=SpanKind.CLIENT, attributes=attributes
                ),
                instance.pool.connection(deadline, fresh) as connection,
            ):
                reused, exchanging = connection.reused, True
                value = self._exchange(connection, method, deadline, deadline_ms, build_args)
            instance.succeeded()
            if method == "get_app_stats":
                self.backups.record(self._clock.monotonic() - started)
            return value
        except TTransportException as failure:
            if failure.type == TTransportException.TIMED_OUT:
                if exchanging:  # no reply in time (not: no free pooled connection here)
                    self.instances.slow(instance)
            elif not reused:
                self.instances.eject(instance)  # a new connection failed: the instance is away
            raise
        finally:
            instance.inflight -= 1

    @staticmethod
    def _exchange(
        connection: Connection,
        method: str,
        deadline: Deadline,
        deadline_ms: int,
        build_args: Callable[[int], tuple[Any, ...]],
    ) -> Any:
        remaining_ms = int(deadline.remaining_ms())
        if remaining_ms <= 0:
            raise TTransportException(
                TTransportException.TIMED_OUT, f"{method}: deadline passed before sending"
            )
        connection.set_timeout_ms(remaining_ms + REPLY_MARGIN_MS)
        args = build_args(remaining_ms)
        try:
            return getattr(connection.client, method)(*args)
        except TimeoutError as exc:
            raise TTransportException(
                TTransportException.TIMED_OUT, f"{method}: no reply within {deadline_ms} ms"
            ) from exc
        except OSError as exc:
            raise TTransportException(TTransportException.UNKNOWN, f"{method}: {exc}") from exc


def _criticality(name: str | None) -> int | None:
    if name is None:
        return None
    value = getattr(appstats.Criticality, str(name).upper(), None)
    if not isinstance(value, int):
        raise ValueError(
            f"criticality: one of CRITICAL_PLUS, CRITICAL, SHEDDABLE_PLUS, SHEDDABLE; got {name!r}"
        )
    return value
