"""An HTTP service as a backend: its own session, slots, guard and health check.

:meth:`HttpBackend.get_json` GETs ``path`` under the service's base URL. Every
attempt is bounded three ways: requests' ``timeout=(connect, read)`` (each at most
the attempt's budget, :func:`connect_timeout_s` and ``read_timeout_ms``), a gevent
timer on the whole exchange (a server that drips bytes cannot stretch it past the
budget), and at most MAX_RESPONSE_BYTES of body. Redirects are not followed:
lookups only ever call the configured base URL. The session ignores proxy and
netrc environment variables (``trust_env = False``), keeps and sends no cookies,
sends ``Authorization: Bearer <auth_token>`` when set, and uses the backend's TLS
files (:mod:`lookups.backends.tls`).

What a failure is reported as::

    refused, reset, 5xx                      BackendUnavailable (retryable; retry_safe
                                             before any answer, and for 502/503/504)
    TLS failed (an untrusted certificate)    BackendUnavailable, not retried
    budget ran out (connect, read, whole)    BackendTimeout
    3xx, 4xx, too large, not JSON            BadBackendResponse (not retryable)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from http.cookiejar import DefaultCookiePolicy
from types import MappingProxyType
from typing import Any, ClassVar, NoReturn, TypeVar
from urllib.parse import urlencode, urlsplit

import gevent
import requests
from requests.adapters import HTTPAdapter
from requests.hooks import default_hooks
from requests.structures import CaseInsensitiveDict

from lookups.backends.base import Backend
from lookups.backends.http_check import HttpCheck
from lookups.backends.settings import HttpBackendSettings
from lookups.backends.tls import HttpsFiles, load_https_files
from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from lookups.errors import (
    BackendTimeout,
    BackendUnavailable,
    BadBackendResponse,
    LookupFailed,
    blame_own_wait,
)
from lookups.resilience import RetryPolicy
from tracing.clients import remote_call
from tracing.context import inject_headers
from tracing.http_spans import http_request_span

__all__ = ["HttpBackend", "MAX_RESPONSE_BYTES", "connect_timeout_s"]

T = TypeVar("T")

MAX_RESPONSE_BYTES = 4 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024
# Answers that say "not now" from a gateway or an overloaded server: safe to try again.
_RETRY_SAFE_STATUS = frozenset({502, 503, 504})
_NO_COOKIES = requests.cookies.RequestsCookieJar()


def connect_timeout_s(settings: HttpBackendSettings, left_s: float) -> float:
    """The connect timeout of one attempt with ``left_s`` left.

    At least ``connect_timeout_ms``, and up to half the budget: a listen queue that is
    full drops the SYN, and Linux sends it again after 1 s, then 3 s. With budget to
    spare, one attempt then lives through those retransmissions; with little, it gives
    up early enough for a retry's fresh SYN. Never past the budget.
    """
    return min(left_s, max(settings.connect_timeout_ms / 1000.0, left_s / 2.0))


class HttpBackend(Backend):
    """The HTTP service at ``settings.url``, with ``pool_size`` calls in flight at most.

    Raises :class:`ValueError` naming the key when a TLS file does not load.
    """

    kind: ClassVar[str] = "http"

    def __init__(
        self,
        name: str,
        settings: HttpBackendSettings,
        policies: Mapping[str, RetryPolicy] = MappingProxyType({}),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(name, settings, settings.pool_size, policies, clock)
        https = load_https_files(settings)
        self.session = _session(settings, https, settings.pool_size)
        # The health check's own connection: a full lookup pool cannot delay it.
        self._check = HttpCheck(_check_url(settings), https, settings.authorization)
        self._adapter = self.session.get_adapter(settings.url)
        self._base = _prepared_base(settings.url)
        parts = urlsplit(self._base)
        self._address = (parts.hostname or "", parts.port)  # for the client span

    def get_json(
        self, lookup: str, path: str, params: dict[str, int], deadline: Deadline, route: str = ""
    ) -> Any:
        """The JSON answer to ``GET <url><path>?<params>``, guarded, by ``deadline``.

        ``path`` is already quoted; ``route`` is its template (``/apps/{app}/alerts``),
        which names the call's span.
        """
        url = self._base + path
        body = self.call(
            lookup,
            lambda attempt_deadline: self._get_body(lookup, url, params, route, attempt_deadline),
            deadline,
        )
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except ValueError as exc:
            raise BadBackendResponse(f"{lookup}: response is not valid JSON") from exc

    def attempt(self, lookup: str, operation: Callable[[Deadline], T], deadline: Deadline) -> T:
        """``operation(deadline)`` holding a slot, the slot's wait and the whole exchange
        under one timer; a timeout after a long wait for the slot is ours, not the service's."""
        left_s = deadline.remaining_s()
        if left_s <= 0:
            raise BackendTimeout(f"{lookup}: no time left to call the service", backend_fault=False)
        began = deadline.now()
        waited_s: float | None = None  # known once the slot is ours
        timer = gevent.Timeout(left_s)
        timer.start()
        try:
            if not self.slots.acquire(timeout=left_s, flow=deadline.flow):
                raise BackendTimeout(
                    f"{lookup}: no free connection to the service within {left_s:.3f}s",
                    backend_fault=False,
                )
            waited_s = deadline.now() - began
            try:
                # The timer ends the exchange at the deadline anyway.
                return operation(deadline)
            except BackendTimeout as slow:
                raise blame_own_wait(slow, waited_s, left_s) from slow
        except gevent.Timeout as fired:
            if fired is not timer:
                raise
            # Blamed on the service unless our own slot took a tenth of the budget or more.
            raise blame_own_wait(
                BackendTimeout(f"{lookup}: no complete answer within {left_s:.3f}s"),
                deadline.now() - began if waited_s is None else waited_s,
                left_s,
            ) from None
        finally:
            timer.close()
            if waited_s is not None:
                self.slots.release()

    def check(self, timeout_s: float) -> None:
        """GET ``url`` (or ``url`` + ``health_path``): up on a 2xx or 3xx answer. A 404 is
        down: something answers, but not the service the lookups were pointed at."""
        # The socket's timeouts are per operation; the timer bounds the whole exchange.
        with gevent.Timeout(timeout_s, TimeoutError(f"no answer within {timeout_s:.3f}s")):
            status = self._check.status(timeout_s)
        if not 200 <= status < 400:
            raise HttpStatusError(status)

    def connections_in_use(self) -> int:
        return _connections_in_use(self._adapter)

    def close(self) -> None:
        self.session.close()
        self._check.close()

    def _get_body(
        self, lookup: str, url: str, params: dict[str, int], route: str, deadline: Deadline
    ) -> bytes:
        settings = self.settings
        left_s = max(deadline.remaining_s(), 0.001)  # requests takes seconds
        timeouts = (
            connect_timeout_s(settings, left_s),
            min(settings.read_timeout_ms / 1000.0, left_s),
        )
        prepared = self._prepare(url, params)
        try:
            with (
                remote_call(self.name, route),
                http_request_span(prepared, self._address, self.clock) as sent,
            ):
                response = self.session.send(
                    prepared, timeout=timeouts, stream=True, allow_redirects=False
                )
                sent.answered(response)
        except requests.RequestException as exc:
            _raise_transport_error(lookup, exc, before_response=True)
        try:
            if response.status_code >= 500:
                raise BackendUnavailable(
                    f"{lookup}: service answered HTTP {response.status_code}",
                    retry_safe=response.status_code in _RETRY_SAFE_STATUS,
                )
            if response.status_code >= 300:
                raise BadBackendResponse(f"{lookup}: service answered HTTP {response.status_code}")
            return _read_bounded(lookup, response)
        except requests.RequestException as exc:
            _raise_transport_error(lookup, exc, before_response=False)
        finally:
            # Returns the connection to the pool, or drops it when the body was not read.
            response.close()

    def _prepare(self, url: str, params: dict[str, int]) -> requests.PreparedRequest:
        """The GET, built from parts that need no checking, for ``Session.send``.

        ``Session.get`` merges the session's settings, cookies, hooks and environment
        into a new request on every call, and ``PreparedRequest.prepare`` then parses
        and re-quotes the URL, encodes the parameters and checks every header: together
        a large share of an HTTP lookup's CPU (the merge measured with py-spy, the rest in
        alternating runs). Here the base URL is prepared by
        requests once (:func:`_prepared_base`), the path is one quoted segment under it,
        the parameters are integers, and the headers are the session's and ours. No
        cookies are sent: lookups are stateless, and a backend's ``Set-Cookie`` is not
        kept for the next call. ``Session.send`` (what the requests instrumentation
        traces) still runs.
        """
        prepared = requests.PreparedRequest()
        prepared.method = "GET"
        prepared.url = f"{url}?{urlencode(params)}"
        # The trace context, also with tracing's client spans off: the request's own span
        # (tracing.http_spans), or the requests instrumentation, overwrites it with its own.
        prepared.headers = CaseInsensitiveDict(
            {**self.session.headers, "Accept": "application/json", **inject_headers()}
        )
        prepared.hooks = default_hooks()
        # Read by requests only for a redirect's next request (which is never sent);
        # it copies the jar before writing to it, so this empty one stays empty.
        prepared._cookies = _NO_COOKIES
        return prepared


class HttpStatusError(Exception):
    """A health check answered neither 2xx nor 3xx."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")


def _session(settings: HttpBackendSettings, https: HttpsFiles, pool_size: int) -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # configuration arrives only through the settings
    # Lookups send no cookies (see _prepare): keep none either, so that a backend
    # setting new ones on every answer cannot grow the jar.
    session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
    if settings.authorization:
        session.headers["Authorization"] = settings.authorization
    adapter = HTTPAdapter(
        pool_connections=1, pool_maxsize=pool_size, pool_block=True, max_retries=0
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    https.apply(session)
    return session


def _read_bounded(lookup: str, response: requests.Response) -> bytes:
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
        raise BadBackendResponse(f"{lookup}: response larger than {MAX_RESPONSE_BYTES} bytes")
    chunks, size = [], 0
    for chunk in response.iter_content(_CHUNK_BYTES):
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise BadBackendResponse(f"{lookup}: response larger than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _raise_transport_error(
    lookup: str, exc: requests.RequestException, *, before_response: bool
) -> NoReturn:
    """Typed; ``retry_safe`` when nothing of an answer came yet and the cause was the
    connection (refused, connect timeout, reset), not a slow server."""
    kind = type(exc).__name__
    if isinstance(exc, requests.ConnectTimeout):
        raise BackendTimeout(
            f"{lookup}: no connection to the service ({kind})", retry_safe=True
        ) from exc
    if isinstance(exc, requests.Timeout):
        raise BackendTimeout(f"{lookup}: service too slow ({kind})") from exc
    if isinstance(exc, requests.exceptions.SSLError):
        # An untrusted certificate stays untrusted: no retry within the task.
        raise BackendUnavailable(
            f"{lookup}: TLS with the service failed; does http.ca_file hold its CA? ({kind})"
        ) from exc
    if isinstance(exc, (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)):
        safe = before_response and isinstance(exc, requests.ConnectionError)
        raise BackendUnavailable(
            f"{lookup}: cannot reach the service ({kind})", retry_safe=safe
        ) from exc
    if isinstance(exc, requests.exceptions.ContentDecodingError):
        raise BadBackendResponse(f"{lookup}: undecodable response body ({kind})") from exc
    raise LookupFailed(f"{lookup}: HTTP request failed ({kind})") from exc


def _check_url(settings: HttpBackendSettings) -> str:
    """What a health check GETs: ``url``, or ``url`` + ``health_path``."""
    if settings.health_path:
        return settings.url.rstrip("/") + settings.health_path
    return settings.url


@functools.lru_cache(maxsize=64)
def _prepared_base(base_url: str) -> str:
    """``base_url`` as requests prepares a URL (IDNA host, quoting), without a final ``/``."""
    prepared = requests.PreparedRequest()
    prepared.prepare_url(base_url.rstrip("/"), None)
    return (prepared.url or "").rstrip("/")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _connections_in_use(adapter: Any) -> int:
    """Connections not sitting in the queues of the adapter's urllib3 pools.

    A urllib3 pool's queue starts full (``maxsize`` placeholders); each checkout takes
    one entry out and each release puts one back, so ``maxsize - qsize`` are in use.
    urllib3 has no public count (docs/private-internals.md).
    """
    in_use = 0
    pools = adapter.poolmanager.pools
    for key in list(pools.keys()):
        pool = pools.get(key)
        queue = getattr(pool, "pool", None) if pool is not None else None
        if queue is not None:
            in_use += queue.maxsize - queue.qsize()
    return in_use
