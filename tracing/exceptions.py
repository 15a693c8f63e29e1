"""``exception`` span events with stack traces of file, line and function only.

The SDK's ``Span.record_exception`` formats the source line of every frame
(``traceback.format_exception``): reading each file into ``linecache`` the first
time, a long block of the event loop for a requests failure, and on Python 3.11+
parsing each line to place carets, about a millisecond per failure afterwards,
spent exactly when a failing backend makes every request fail. Its events also
carried several kilobytes of stack trace each.

:class:`ExceptionEventsWithoutSource`, the first processor of every provider
``tracing.setup`` builds, gives each span it starts a ``record_exception`` that
writes the same standard event (OpenTelemetry's exception semantic conventions)
from :func:`stacktrace`, so exceptions recorded by the instrumentations (an
error escaping ``start_as_current_span``) cost what ours do. The SDK offers no
hook for how spans record exceptions; an instance attribute set at start is the
narrowest override (only this provider's recording spans). It holds its span through
a weak proxy: a bound method of the span, stored on the span, made every span a
reference cycle, so that none was freed when it ended but only by the collector's
next young collection, with its attributes, events, links and locks: at 100%
sampling most of what the collector then did, and memory the process kept taking
fresh instead of reusing.
"""

from __future__ import annotations

import functools
import traceback
import weakref
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import Status, StatusCode

__all__ = [
    "ExceptionEventsWithoutSource",
    "exception_attributes",
    "stacktrace",
    "record_error",
    "MAX_STATUS_DESCRIPTION",
]

_MAX_STACK_FRAMES = 40  # the innermost ones, per exception
#: Characters of a span status description, at most.
MAX_STATUS_DESCRIPTION = 200
_MAX_CHAINED = 3  # exceptions of a __cause__ / __context__ chain in one stack trace


def exception_attributes(error: BaseException, escaped: bool = False) -> dict[str, str]:
    """The ``exception`` event's attributes (semantic conventions) for ``error``."""
    return {
        "exception.type": type_name(error),
        "exception.message": str(error),
        "exception.stacktrace": stacktrace(error),
        "exception.escaped": str(escaped),
    }


def stacktrace(error: BaseException) -> str:
    """Like ``traceback.format_exception``, without source lines: file, line and function per
    frame."""
    chain = [error]
    while len(chain) < _MAX_CHAINED:
        cause = chain[-1].__cause__ or (
            None if chain[-1].__suppress_context__ else chain[-1].__context__
        )
        if cause is None or cause in chain:
            break
        chain.append(cause)
    parts: list[str] = []
    for position, exc in enumerate(reversed(chain)):
        if position:
            parts.append(
                "\nThe above exception was the direct cause of the following exception:\n\n"
                if exc.__cause__ is not None
                else "\nDuring handling of the above exception, another exception occurred:\n\n"
            )
        frames = list(traceback.walk_tb(exc.__traceback__))[-_MAX_STACK_FRAMES:]
        if frames:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(
                f'  File "{frame.f_code.co_filename}", line {lineno}, in {frame.f_code.co_name}\n'
                for frame, lineno in frames
            )
        message = str(exc)
        parts.append(f"{type_name(exc)}: {message}\n" if message else f"{type_name(exc)}\n")
    return "".join(parts)


def type_name(error: BaseException) -> str:
    """``module.QualName`` of the error's type (builtins unqualified), as the conventions want."""
    kind = type(error)
    module = kind.__module__
    return (
        kind.__qualname__
        if module in ("builtins", "__main__", None)
        else f"{module}.{kind.__qualname__}"
    )


def _record_exception(
    span: Span,
    exception: BaseException,
    attributes: Any = None,
    timestamp: int | None = None,
    escaped: bool = False,
) -> None:
    """``Span.record_exception``'s signature and event, from :func:`stacktrace`."""
    event = exception_attributes(exception, escaped)
    if attributes:
        event.update(attributes)
    span.add_event(name="exception", attributes=event, timestamp=timestamp)


class ExceptionEventsWithoutSource(SpanProcessor):
    """Gives every span started ``record_exception`` without source lines (module doc)."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        span.record_exception = functools.partial(_record_exception, weakref.proxy(span))  # type: ignore[method-assign]  # per span, by design

    def on_end(self, span: ReadableSpan) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def record_error(span: trace.Span, error: BaseException) -> None:
    """The ``exception`` event (OpenTelemetry semantic conventions) and status ERROR; never
    raises."""
    if not span.is_recording():
        return
    try:
        span.add_event("exception", exception_attributes(error))
        span.set_status(Status(StatusCode.ERROR, _describe(error)))
    except Exception:  # noqa: BLE001 - tracing must never fail the call it describes
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))


def _describe(error: BaseException) -> str:
    text = str(error)
    description = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return description[:MAX_STATUS_DESCRIPTION]
