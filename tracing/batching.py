"""The batch span processor, sized for a busy server.

Finished spans wait in a queue; the processor's worker (a greenlet, once gevent
has patched ``threading``) exports them in batches, off the request path. The
standard variables set its sizes; where one is not set, Fanout's default applies:

============================== ========== ===== ====================================================
variable                       Fanout     SDK   why
============================== ========== ===== ====================================================
OTEL_BSP_MAX_QUEUE_SIZE        8192       2048  a few seconds of a busy worker's spans (15 per
                                                call), so a slow collector does not drop at once
OTEL_BSP_MAX_EXPORT_BATCH_SIZE 512        512   fewer, larger exports: each costs an HTTP request
OTEL_BSP_SCHEDULE_DELAY        5000 (ms)  5000  a quiet server still exports every 5 s
============================== ========== ===== ====================================================

When the queue is full the SDK drops new spans; its own filter then logs the
same warning at most once per 20 s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

__all__ = ["BSP_DEFAULTS", "batch_processor"]

#: Fanout's defaults for the standard batch-processor variables.
BSP_DEFAULTS: Mapping[str, int] = {
    "OTEL_BSP_MAX_QUEUE_SIZE": 8192,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512,
    "OTEL_BSP_SCHEDULE_DELAY": 5000,
}

_log = logging.getLogger(__name__)


def batch_processor(exporter: SpanExporter, env: Mapping[str, str]) -> BatchSpanProcessor:
    """A ``BatchSpanProcessor`` for ``exporter``, sized by ``env``'s ``OTEL_BSP_*``.

    Where one is not set, :data:`BSP_DEFAULTS` applies.

    A value that is not a positive integer is logged and replaced by the default.
    A batch larger than the queue is cut to the queue's size.
    """
    sizes = {name: _positive_int(env, name) for name in BSP_DEFAULTS}
    queue = sizes["OTEL_BSP_MAX_QUEUE_SIZE"]
    return BatchSpanProcessor(
        exporter,
        max_queue_size=queue,
        max_export_batch_size=min(sizes["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"], queue),
        schedule_delay_millis=sizes["OTEL_BSP_SCHEDULE_DELAY"],
    )


def _positive_int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return BSP_DEFAULTS[name]
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value > 0:
        return value
    _log.warning("%s=%r is not a positive integer; using %d", name, raw, BSP_DEFAULTS[name])
    return BSP_DEFAULTS[name]
