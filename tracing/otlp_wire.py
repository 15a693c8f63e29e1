"""OTLP trace export requests, written straight to protobuf wire bytes.

The OTLP exporters encode a batch by building a protobuf object per span,
attribute and value, then serialising the tree, all on this process's one core; at full
sampling (15 spans per call) that is the largest part of what tracing costs.
:func:`encode_spans` writes the same ``ExportTraceServiceRequest`` directly, for a
fraction of that CPU (the manual's Performance page has the figures). It follows the
SDK encoder field for field (``opentelemetry.exporter.otlp.proto.common``): the
tests decode both outputs and require equal messages, for every kind of value.

There is no official hook for the exporter's encoder, so
:func:`use_for_http_export` swaps the encoder the OTLP/HTTP exporter module
calls (its ``encode_spans``); if a future exporter version no longer has one,
the swap is skipped and the SDK's encoder goes on working.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["encode_spans", "EncodedRequest", "use_for_http_export"]

_log = logging.getLogger(__name__)

_pack_fixed64 = struct.Struct("<Q").pack
_pack_double = struct.Struct("<d").pack
_SMALL_VARINTS = [bytes((n,)) for n in range(128)]
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Span.kind: SDK SpanKind value -> field 6 (varint) with the OTLP enum value (SDK value + 1).
_KIND_FIELD = [b"\x30" + bytes((value + 1,)) for value in range(5)]
# Span.flags (field 16, fixed32): "has is_remote", plus "is_remote" for a remote parent.
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)
# Link.flags (field 6, fixed32).
_LINK_FLAGS_LOCAL = b"\x35" + struct.pack("<I", 0x100)
_LINK_FLAGS_REMOTE = b"\x35" + struct.pack("<I", 0x300)
_MAX_CACHED = 4096  # encoded constant attributes and key names kept
# Span.status (field 15) without a description, by status code (UNSET, OK, ERROR).
_EMPTY_STATUS = [b"\x7a\x00", b"\x7a\x02\x18\x01", b"\x7a\x02\x18\x02"]
_constant_attributes: dict[tuple[bytes, str, Any], bytes] = {}
_key_fields: dict[str, bytes] = {}
_span_names: dict[str, bytes] = {}


class EncodedRequest:
    """Wire bytes standing in for the protobuf message the exporter serialises."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def SerializeToString(self) -> bytes:
        return self._data

    def SerializePartialToString(self) -> bytes:
        return self._data


def use_for_http_export(exporter_module: ModuleType) -> bool:
    """Make the OTLP/HTTP exporter module encode with :func:`encode_spans`; True if it could."""
    if not callable(getattr(exporter_module, "encode_spans", None)):
        _log.debug("%s has no encode_spans; keeping the SDK's encoder", exporter_module.__name__)
        return False
    exporter_module.encode_spans = _encode_request  # type: ignore[attr-defined]  # checked above
    return True


def _encode_request(spans: Sequence[Any]) -> EncodedRequest:
    return EncodedRequest(encode_spans(spans))


def encode_spans(spans: Sequence[Any]) -> bytes:
    """``ExportTraceServiceRequest`` bytes for finished SDK spans, grouped by resource, then
    scope."""
    requests = []
    for resource, scopes in _grouped(spans).items():
        body = [_field(b"\x0a", _attributes(b"\x0a", resource.attributes))]
        body.extend(
            _field(b"\x12", _scope_spans(scope, encoded)) for scope, encoded in scopes.items()
        )
        body.append(_string(b"\x1a", resource.schema_url))
        requests.append(_field(b"\x0a", b"".join(body)))
    return b"".join(requests)


def _grouped(spans: Sequence[Any]) -> dict[Any, dict[Any, list[bytes]]]:
    """Encoded spans by resource, then scope, in order of first appearance (as the SDK encoder).

    Grouping goes by identity first: hashing a ``Resource`` serialises its attributes
    to JSON, per span. Equal but distinct resources or scopes (several providers
    sharing one exporter) are regrouped by equality, exactly as the SDK encoder does.
    """
    by_identity: dict[tuple[int, int], list[bytes]] = {}
    objects: dict[tuple[int, int], tuple[Any, Any]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        key = (id(resource), id(scope))
        encoded = by_identity.get(key)
        if encoded is None:
            encoded = by_identity[key] = []
            objects[key] = (resource, scope)
        encoded.append(_span(span))
    distinct = list(objects.values())
    if len(set(distinct)) < len(distinct):
        return _grouped_by_equality(spans)
    grouped: dict[Any, dict[Any, list[bytes]]] = {}
    for key, encoded in by_identity.items():
        resource, scope = objects[key]
        grouped.setdefault(resource, {})[scope] = encoded
    return grouped


def _grouped_by_equality(spans: Sequence[Any]) -> dict[Any, dict[Any, list[bytes]]]:
    grouped: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        scopes = grouped.setdefault(span.resource, {})
        scopes.setdefault(span.instrumentation_scope or None, []).append(_span(span))
    return grouped


def _scope_spans(scope: Any, encoded: list[bytes]) -> bytes:
    if scope is None:
        head = b"\x0a\x00"  # an empty InstrumentationScope, as the SDK encoder sends
        schema_url = ""
    else:
        head = _field(
            b"\x0a",
            _string(b"\x0a", scope.name)
            + _string(b"\x12", scope.version)
            + _attributes(b"\x1a", scope.attributes),
        )
        schema_url = scope.schema_url
    spans = b"".join(b"\x12" + _varint(len(span)) + span for span in encoded)
    return head + spans + _string(b"\x1a", schema_url)


def _span(span: Any) -> bytes:
    context = span.get_span_context()
    parent = span.parent
    out = (
        b"\x0a\x10"
        + context.trace_id.to_bytes(16, "big")
        + b"\x12\x08"
        + context.span_id.to_bytes(8, "big")
    )
    if context.trace_state:
        out += _string(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items()))
    if parent is not None:
        out += b"\x22\x08" + parent.span_id.to_bytes(8, "big")
    out += _name(span.name) + _KIND_FIELD[span.kind.value]
    if span.start_time:
        out += b"\x39" + _pack_fixed64(span.start_time)
    if span.end_time:
        out += b"\x41" + _pack_fixed64(span.end_time)
    out += _attributes(b"\x4a", span.attributes)
    if span.dropped_attributes:
        out += b"\x50" + _varint(span.dropped_attributes)
    for event in span.events:
        out += _field(b"\x5a", _event(event))
    if span.dropped_events:
        out += b"\x60" + _varint(span.dropped_events)
    for link in span.links:
        out += _field(b"\x6a", _link(link))
    if span.dropped_links:
        out += b"\x70" + _varint(span.dropped_links)
    result: bytes = (
        out
        + _status(span.status)
        + (_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    )
    return result


def _name(name: str) -> bytes:
    return _cached_string(_span_names, b"\x2a", name)


def _event(event: Any) -> bytes:
    time = b"\x09" + _pack_fixed64(event.timestamp) if event.timestamp else b""
    return (
        time
        + _string(b"\x12", event.name)
        + _attributes(b"\x1a", event.attributes)
        + _count(b"\x20", event.dropped_attributes)
    )


def _link(link: Any) -> bytes:
    context = link.context
    result: bytes = (
        b"\x0a\x10"
        + context.trace_id.to_bytes(16, "big")
        + b"\x12\x08"
        + context.span_id.to_bytes(8, "big")
        + _attributes(b"\x22", link.attributes)
        + _count(b"\x28", link.dropped_attributes)
        + (_LINK_FLAGS_REMOTE if context.is_remote else _LINK_FLAGS_LOCAL)
    )
    return result


def _status(status: Any) -> bytes:
    if status is None:
        return b""
    if not status.description:
        result: bytes = _EMPTY_STATUS[status.status_code.value]
        return result
    body = _string(b"\x12", status.description) + _count(b"\x18", status.status_code.value)
    return _field(b"\x7a", body)


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated ``KeyValue`` under ``tag``; a value the SDK encoder rejects is left out, logged."""
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        kind = type(value)
        cache_key = (tag, key, value) if kind is str or kind is bool else None
        encoded = _constant_attributes.get(cache_key) if cache_key else None
        if encoded is None:
            try:
                encoded = _field(tag, _key(key) + _field(b"\x12", _any_value(value)))
            except (TypeError, ValueError) as error:
                _log.error("Failed to encode key %s: %s", key, error)
                continue
            if cache_key and len(_constant_attributes) < _MAX_CACHED:
                _constant_attributes[cache_key] = encoded
        out.append(encoded)
    return b"".join(out)


def _key(key: str) -> bytes:
    return _cached_string(_key_fields, b"\x0a", key)


def _cached_string(cache: dict[str, bytes], tag: bytes, text: str) -> bytes:
    """``text`` encoded as field ``tag``, from a cache bounded at ``_MAX_CACHED`` entries."""
    encoded = cache.get(text)
    if encoded is None:
        encoded = _string(tag, text)
        if len(cache) < _MAX_CACHED:
            cache[text] = encoded
    return encoded


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` body, checked in the SDK encoder's order (bool before int)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _string(b"\x0a", value, keep_empty=True)
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"Value out of range: {value}")
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, bytes):
        return b"\x3a" + _varint(len(value)) + value
    if isinstance(value, Sequence):
        values = b"".join(_field(b"\x0a", _any_value(item)) for item in value)
        return _field(b"\x2a", values)
    if isinstance(value, Mapping):
        pairs = b"".join(
            _field(b"\x0a", _key(str(k)) + _field(b"\x12", _any_value(v))) for k, v in value.items()
        )
        return _field(b"\x32", pairs)
    raise TypeError(f"Invalid type {type(value)} of value {value}")


def _string(tag: bytes, text: str | None, keep_empty: bool = False) -> bytes:
    """A string field; empty is left out (proto3), except inside a oneof (``keep_empty``)."""
    if not text and not keep_empty:
        return b""
    data = (text or "").encode("utf-8")
    return tag + _varint(len(data)) + data


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _count(tag: bytes, count: int) -> bytes:
    return tag + _varint(count) if count else b""


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
