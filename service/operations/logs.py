"""Log set-up: plain text for a terminal, JSON for a log platform.

``logging.format = "json"`` writes one JSON object per line (python-json-logger)::

    {"time": "2026-11-23T09:58:01.204Z", "level": "WARNING", "logger": "lookups.resilience.breaker",
     "message": "circuit mongo: closed -> open for 2000 ms (failing fast)",
     "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7",
     "request_id": "web-42"}

Every line logged inside a call carries the call's ``trace_id`` and the current
``span_id`` (from OpenTelemetry's logging instrumentation, which reads the
current span when the record is made) and its ``request_id`` (the caller's
``meta.request_id``, else the one the server made up). Outside a call they are
``"0"`` and empty. Text stays the default; its lines are unchanged.

Under ``server.workers`` every line says which process wrote it: ``"worker":
"0"`` (the worker's position; a restarted worker keeps its position's number) or
``"master"`` in JSON, and ``worker 0: `` or ``master: `` before the logger's name
in text. A single-process server leaves it empty.
"""

from __future__ import annotations

import datetime
import logging
import sys
from dataclasses import dataclass, field
from typing import TextIO

from service.engine.tasks import current_request_id

__all__ = [
    "JSON_FIELDS",
    "LoggingSettings",
    "configure_logging",
    "set_request_id",
    "set_worker",
    "TEXT_FORMAT",
    "console_line",
]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(worker_tag)s%(name)s: %(message)s"
#: The fields of every JSON line, in order (the manual's log reference is made from these).
JSON_FIELDS = ("time", "level", "logger", "message", "trace_id", "span_id", "request_id", "worker")
_RECORD_NAMES = {"time": "asctime", "level": "levelname", "logger": "name"}
_JSON_FIELDS = " ".join(f"%({_RECORD_NAMES.get(f, f)})s" for f in JSON_FIELDS)

# The process's part in a pre-forked server: "master", a worker's position, or "" alone.
_worker = ""
# The attributes OpenTelemetry's logging instrumentation and our text format add to a
# record: JSON carries them once, as trace_id, span_id and worker, not twice.
_NOT_IN_JSON = ("otelSpanID", "otelTraceID", "otelTraceSampled", "otelServiceName", "worker_tag")
# The JSON formatter when logging.format is json: console_line() writes like the log.
_json_handler: logging.Handler | None = None


@dataclass(frozen=True)
class LoggingSettings:
    """The ``[logging]`` section."""

    format: str = field(
        default="text",
        metadata={
            "help": "`json`: one JSON object per line, with `time`, `level`, `logger`, `message`, "
            "and for lines logged inside a call its `trace_id`, `span_id` and `request_id` "
            "(see [Logs](../reference/logs.md))",
            "choices": ("text", "json"),
        },
    )


def set_request_id(request_id: str) -> None:
    """Name the call being served in the log lines written for it from now on (the
    handler sets :data:`service.engine.tasks.current_request_id` itself)."""
    current_request_id.set(request_id)


def set_worker(worker: str) -> None:
    """Name this process in every line it logs from now on: ``"master"`` or a worker's position."""
    global _worker
    _worker = worker


class _CallIds(logging.Filter):
    """Adds ``trace_id``, ``span_id``, ``request_id`` and the worker to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id = getattr(record, "otelTraceID", "0")
        record.span_id = getattr(record, "otelSpanID", "0")
        record.request_id = current_request_id.get()
        record.worker = _worker
        record.worker_tag = (
            "" if not _worker else ("master: " if _worker == "master" else f"worker {_worker}: ")
        )
        return True


def configure_logging(settings: LoggingSettings, level: str, stream: TextIO = sys.stderr) -> None:
    """Send the root logger's records at ``level`` and above to ``stream``, as ``settings`` says."""
    from opentelemetry.instrumentation.logging import LoggingInstrumentor

    from tracing.conventions import prefer_stable_conventions

    instrumentor = LoggingInstrumentor()
    prefer_stable_conventions()  # this is the process's first instrumentor: it fixes them
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(inject_trace_context=True, set_logging_format=False)
    handler = logging.StreamHandler(stream)
    handler.addFilter(_CallIds())
    global _json_handler
    _json_handler = None
    if settings.format == "json":
        from pythonjsonlogger.core import RESERVED_ATTRS
        from pythonjsonlogger.json import JsonFormatter

        class Rfc3339JsonFormatter(JsonFormatter):
            """``time`` as RFC 3339 in UTC, to the millisecond (``2026-12-07T01:35:45.272Z``):
            what log platforms read without guessing a zone."""

            def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
                at = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
                return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")

        handler.setFormatter(
            Rfc3339JsonFormatter(
                _JSON_FIELDS,
                rename_fields={record: field for field, record in _RECORD_NAMES.items()},
                reserved_attrs=[*RESERVED_ATTRS, *_NOT_IN_JSON],
            )
        )
        _json_handler = handler
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def console_line(message: str) -> str:
    """What ``fanout serve`` prints on standard output (``fanout: MESSAGE``), or, when the
    log is JSON, the same as one JSON line of the log, so a log platform reading both
    streams gets JSON only."""
    if _json_handler is None:
        return f"fanout: {message}"
    record = logging.LogRecord("fanout", logging.INFO, __file__, 0, message, None, None)
    _json_handler.filter(record)
    return _json_handler.format(record)
