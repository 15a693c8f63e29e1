"""The RPC server's metric: ``rpc.server.call.duration``, by the semantic conventions.

One histogram (seconds) over every call, from decoding to the reply written, with
``rpc.system.name`` (``apache_thrift``), ``rpc.method`` (``AppStats/<method>``) and,
for calls answered with an exception, ``error.type`` (the exception's name). In Prometheus:
``rpc_server_call_duration_seconds_*``.

A method the IDL does not declare is recorded as ``rpc.method`` ``_OTHER``, as the
semantic conventions ask: names a caller makes up must not make series (50 bogus
names made 50). Every call that was read is recorded once, its reply written or
not (a reply that could not be written has that failure as its ``error.type``).
"""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.semconv._incubating.metrics.rpc_metrics import create_rpc_server_call_duration

from service.idl import appstats
from tracing.spans import rpc_attributes

__all__ = ["call_ended", "OTHER_METHOD"]

#: ``rpc.method`` of a call to a method the IDL does not declare.
OTHER_METHOD = "_OTHER"
_DECLARED = frozenset(appstats.AppStats.thrift_services)

_duration = create_rpc_server_call_duration(metrics.get_meter("fanout.server"))
_attributes: dict[tuple[str, str], dict[str, str]] = {}


def call_ended(method: str, error_type: str, seconds: float) -> None:
    """Record one call; ``error_type`` is empty for a normal answer."""
    if method not in _DECLARED:
        method = OTHER_METHOD
    key = (method, error_type)
    attributes = _attributes.get(key)
    if attributes is None:
        attributes = rpc_attributes(method)
        if method == OTHER_METHOD:
            attributes["rpc.method"] = OTHER_METHOD
        if error_type:
            attributes["error.type"] = error_type
        if len(_attributes) < 256:  # methods x exception types: a few dozen at most
            _attributes[key] = attributes
    _duration.record(seconds, attributes)
