"""An exporter that cannot export said once, and again when it can.

Without a collector listening, the SDK's exporters log a WARNING or an ERROR for every
batch that fails (and its retries): a server traced by default and started without a
collector writes several lines a second while it waits, each saying the same. So each
exporter runs behind :class:`ReportedExporter`: the first batch that fails lets the
exporter's own lines through and adds one WARNING of ours; until a batch is exported
again, the exporter's lines are dropped (:class:`QuietWhileDown`) and the failed batches
counted; the first batch that goes through says so at INFO, with that count. The Redis
store of the results cache reports its outages the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["ReportedExporter", "QuietWhileDown", "EXPORTER_LOGGERS"]

log = logging.getLogger(__name__)

#: The loggers the SDK's exporters and batch processor write their failures to.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.zipkin.json",
    "opentelemetry.sdk.trace.export",
)


class QuietWhileDown(logging.Filter):
    """Drops the exporters' lines while an outage already said is going on."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = 0  # exporters whose outage was said and goes on

    def filter(self, record: logging.LogRecord) -> bool:
        return self.quiet == 0 or record.levelno >= logging.CRITICAL


#: One for the process: the exporters' loggers are the process's.
_QUIET = QuietWhileDown()


def _install_filter() -> None:
    for name in EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


class ReportedExporter(SpanExporter):
    """``exporter``, its outages said once each: ``where`` names it in the lines."""

    def __init__(self, exporter: SpanExporter, where: str) -> None:
        self.exporter = exporter
        self._where = where
        self._down = False
        self.failed_batches = 0  # in the outage going on, or the last one
        _install_filter()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            if self._down:
                self._down = False
                _QUIET.quiet -= 1
                log.info(
                    "tracing: spans are exported to %s again (%d batches failed meanwhile)",
                    self._where,
                    self.failed_batches,
                )
            return result
        if not self._down:
            self._down, self.failed_batches = True, 0
            _QUIET.quiet += 1
            log.warning(
                "tracing: spans could not be exported to %s; they are dropped, and this is "
                "said again once a batch goes through",
                self._where,
            )
        self.failed_batches += 1
        return result

    def shutdown(self) -> None:
        if self._down:
            self._down = False
            _QUIET.quiet -= 1
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)
