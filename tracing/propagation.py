"""Trace context across the Thrift hop: W3C ``traceparent``/``tracestate`` and ``baggage``.

The caller's headers travel in ``RequestMeta.headers``. They come from outside,
so :func:`extract_context` trusts nothing: header names are matched without
regard to case, over-long values are dropped, and anything the propagator cannot
parse gives a fresh root context instead of an exception.
"""

from __future__ import annotations

import logging
from typing import Mapping

from opentelemetry import propagate
from opentelemetry.context import Context

__all__ = ["MAX_HEADER_CHARS", "MAX_HEADERS", "extract_context", "inject_headers",
           "propagation_fields"]

# W3C caps tracestate at 32 members (~512 chars useful) and baggage at 8192 bytes;
# anything longer is not a header a well-behaved caller sends.
MAX_HEADER_CHARS = 8192
# Only this many header entries are looked at; the rest cannot hold trace context we honour.
MAX_HEADERS = 64

_log = logging.getLogger(__name__)


def extract_context(headers: Mapping[str, str]) -> Context:
    """The context the caller's ``headers`` describe, or an empty (root) context.

    Never raises for bad input: malformed, over-long or non-string values are ignored.
    """
    if not headers:
        return Context()
    try:
        carrier = _trace_headers(headers)
        return propagate.extract(carrier, context=Context()) if carrier else Context()
    except Exception:  # noqa: BLE001 - a caller's junk must never fail the request
        _log.debug("ignoring unparseable trace-context headers", exc_info=True)
        return Context()


def inject_headers() -> dict[str, str]:
    """The current trace context (and baggage) as a fresh dict of propagation headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def propagation_fields() -> frozenset[str]:
    """The header names the configured propagators read, lower-case.

    W3C ``traceparent``, ``tracestate`` and ``baggage`` by default; others when
    ``OTEL_PROPAGATORS`` names other propagators (b3, jaeger, ...).
    """
    return frozenset(field.lower() for field in propagate.get_global_textmap().fields)


def _trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The propagator's own fields from ``headers``, lower-cased, with sane values only."""
    wanted = propagation_fields()
    carrier: dict[str, str] = {}
    for count, (name, value) in enumerate(headers.items()):
        if count >= MAX_HEADERS:
            break
        if not isinstance(name, str) or not isinstance(value, str) or len(value) > MAX_HEADER_CHARS:
            continue
        lowered = name.lower()
        if lowered in wanted:
            carrier[lowered] = value
    return carrier
