"""Which semantic conventions the official instrumentations emit: the stable ones.

The instrumentations read ``OTEL_SEMCONV_STABILITY_OPT_IN`` once per process, at
the first ``instrument()`` of any of them (the logging one included). Unless the
variable says otherwise, Fanout asks for the stable HTTP and database
conventions: ``http.client.request.duration`` in seconds, ``server.address``,
``db.system.name``, rather than ``http.client.duration`` in milliseconds.
"""

from __future__ import annotations

import os

__all__ = ["SEMCONV_OPT_IN", "prefer_stable_conventions"]

SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"


def prefer_stable_conventions() -> None:
    """Default the opt-in to the stable conventions; call before the first instrumentor."""
    os.environ.setdefault(SEMCONV_OPT_IN, "http,database")
