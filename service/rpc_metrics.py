"""The RPC server's metric: ``rpc.server.call.duration``, by the semantic conventions.

One histogram (seconds) over every call, from decoding to the reply written, with
``rpc.system.name`` (``apache_thrift``), ``rpc.method`` (``AppStats/<method>``) and,
for calls answered with an exception, ``error.type`` (the exception's name). In Prometheus:
``rpc_server_call_duration_seconds_*``.
"""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.semconv._incubating.metrics.rpc_metrics import create_rpc_server_call_duration

from tracing.spans import rpc_attributes

__all__ = ["call_ended"]

_duration = create_rpc_server_call_duration(metrics.get_meter("fanout.server"))
_attributes: dict[tuple[str, str], dict[str, str]] = {}


def call_ended(method: str, error_type: str, seconds: float) -> None:
    """Record one call; ``error_type`` is empty for a normal answer."""
    key = (method, error_type)
    attributes = _attributes.get(key)
    if attributes is None:
        attributes = rpc_attributes(method)
        if error_type:
            attributes["error.type"] = error_type
        if len(_attributes) < 256:  # methods x exception types: a few dozen at most
            _attributes[key] = attributes
    _duration.record(seconds, attributes)
