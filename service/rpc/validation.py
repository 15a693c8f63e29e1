"""Checks a Thrift ``StatsRequest`` and turns it into plain, trusted values.

Every rule raises ``InvalidRequest`` naming the offending field, before any
value reaches a query, a URL or a log line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lookups.panels import Window
from service.engine.settings import CALLER_PATTERN, CALLER_RULE, FanOutSettings
from service.idl import appstats
from service.overload.brownout import Criticality
from tracing.context import propagation_fields

__all__ = ["ValidRequest", "validate_stats_request", "APP_PATTERN", "MAX_DEADLINE_MS"]

APP_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_DEADLINE_MS = 10 * 60 * 1000
MAX_EPOCH_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last instant BSON dates hold
MAX_HEADERS = 16
MAX_HEADER_BYTES = 4096


@dataclass(frozen=True)
class ValidRequest:
    window: Window
    panels: tuple[str, ...]
    deadline_ms: int
    request_id: str | None
    headers: Mapping[str, str]
    criticality: Criticality = Criticality.CRITICAL
    fresh: bool = False
    caller: str | None = None


def _invalid(field: str, message: str) -> appstats.InvalidRequest:
    return appstats.InvalidRequest(message=f"{field}: {message}", field=field)


def validate_stats_request(
    request: Any, known_panels: Sequence[str], default_panels: Sequence[str], fanout: FanOutSettings
) -> ValidRequest:
    """Validate ``request`` against the panels this server knows and the fan-out limits.

    ``default_panels`` are gathered when the request names none.

    Raises ``appstats.InvalidRequest`` (with ``field`` set) on the first bad field.
    """
    if request is None:
        raise _invalid("request", "is required")
    window = _window(request, fanout.max_window_ms)
    panels = _panels(request.panels, known_panels, default_panels)
    meta = request.meta or appstats.RequestMeta()
    return ValidRequest(
        window,
        panels,
        _deadline_ms(meta.deadline_ms, fanout.request_deadline_ms),
        _request_id(meta.request_id),
        _headers(meta.headers),
        _criticality(meta.criticality),
        _fresh(meta.fresh),
        _caller(meta.caller),
    )


def _window(request: Any, max_window_ms: int) -> Window:
    app = request.app
    if not isinstance(app, str) or not app:
        raise _invalid("app", "is required")
    if not APP_PATTERN.fullmatch(app):
        raise _invalid(
            "app",
            "must be 1-64 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        )
    for field in ("start_ms", "end_ms"):
        value = getattr(request, field)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _invalid(field, "is required")
        if not 0 <= value <= MAX_EPOCH_MS:
            raise _invalid(field, f"must be epoch milliseconds between 0 and {MAX_EPOCH_MS}")
    if request.end_ms <= request.start_ms:
        raise _invalid("end_ms", "must be greater than start_ms (the window is [start_ms, end_ms))")
    if request.end_ms - request.start_ms > max_window_ms:
        raise _invalid("end_ms", f"window longer than the {max_window_ms} ms this server allows")
    return Window(app, request.start_ms, request.end_ms)


def _panels(
    requested: Sequence[str] | None, known: Sequence[str], default: Sequence[str]
) -> tuple[str, ...]:
    if requested is None:
        return tuple(default)
    if not requested:
        raise _invalid("panels", "must name at least one panel (omit it to get all)")
    if len(requested) > len(known):
        raise _invalid("panels", f"lists {len(requested)} panels; this server has {len(known)}")
    unknown = [name for name in requested if name not in known]
    if unknown:
        shown = ", ".join(repr(name[:64]) for name in unknown[:5])
        raise _invalid("panels", f"unknown panel(s) {shown}; known: {', '.join(known)}")
    if len(set(requested)) != len(requested):
        raise _invalid("panels", "lists a panel more than once")
    return tuple(requested)


def _deadline_ms(requested: int | None, server_max_ms: int) -> int:
    if requested is None:
        return server_max_ms
    if requested <= 0 or requested > MAX_DEADLINE_MS:
        raise _invalid("meta.deadline_ms", f"must be between 1 and {MAX_DEADLINE_MS} ms")
    return min(requested, server_max_ms)


def _request_id(request_id: str | None) -> str | None:
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise _invalid(
            "meta.request_id", "must be 1-64 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return request_id


def _headers(headers: Mapping[str, str] | None) -> Mapping[str, str]:
    if not headers:
        return {}
    if len(headers) > MAX_HEADERS:
        raise _invalid("meta.headers", f"has {len(headers)} entries; at most {MAX_HEADERS}")
    # Only the configured propagators' headers are kept; nothing else from the caller
    # reaches the request context, a span or a log.
    wanted = propagation_fields()
    kept = {}
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise _invalid("meta.headers", "keys and values must be strings")
        if len(key) + len(value) > MAX_HEADER_BYTES:
            raise _invalid(
                "meta.headers", f"entry {key[:64]!r} is longer than {MAX_HEADER_BYTES} characters"
            )
        if key.lower() in wanted:
            kept[key.lower()] = value
    return kept


def _fresh(value: object) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid("meta.fresh", f"must be a bool, got {type(value).__name__}")
    return value


def _caller(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not CALLER_PATTERN.fullmatch(value):
        raise _invalid("meta.caller", CALLER_RULE)
    return value


def _criticality(value: int | None) -> Criticality:
    """Absent: CRITICAL, so callers that say nothing are served as before brownout."""
    if value is None:
        return Criticality.CRITICAL
    if not isinstance(value, int) or isinstance(value, bool) or value not in _CRITICALITIES:
        raise _invalid(
            "meta.criticality",
            "must be one of " + ", ".join(f"{c.name} ({c.value})" for c in Criticality),
        )
    return _CRITICALITIES[value]


#: The IDL's values, by number; the IDL and :class:`Criticality` use the same numbers.
_CRITICALITIES = {getattr(appstats.Criticality, c.name): c for c in Criticality}
