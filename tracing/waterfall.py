"""A text waterfall of one trace, for terminals and test failure messages.

Each span is one line: its name indented by depth, a bar placed on a shared time
axis (earliest start to latest end), and its duration. Parallel work shows as bars
that share columns::

    trace 5b8aa5a2d2c872e8321cf37308d69df2  201.3 ms  3 spans
    AppStats/getStats          |##################################################|  201.3 ms
      fanout.task errors       | ###############                                  |   60.2 ms
      fanout.task alerts       | ##########################                       |  104.9 ms
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode, format_trace_id

__all__ = ["render_waterfall"]

_INDENT = "  "
_MAX_LABEL_CHARS = 60
_SpanKey = tuple[int, int]


def render_waterfall(spans: Sequence[ReadableSpan], width: int = 50) -> str:
    """Render ``spans`` (finished SDK spans of one trace) as text, one line per span after a header.

    Spans whose parent is not among ``spans`` are roots. Returns ``""`` for no spans.
    Raises ``ValueError`` if ``width`` is less than 1.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    started = [span for span in spans if span.start_time is not None]
    if not started:
        return ""
    origin = min(_start_ns(span) for span in started)
    finish = max(_end_ns(span) for span in started)
    total_ns = max(finish - origin, 1)
    ordered = _tree_order(started)
    labels = [_label(depth, span.name) for depth, span in ordered]
    label_width = max(len(label) for label in labels)
    lines = [_header(started, total_ns)]
    for label, (_, span) in zip(labels, ordered):
        bar = _bar(_start_ns(span) - origin, _end_ns(span) - origin, total_ns, width)
        duration_ms = (_end_ns(span) - _start_ns(span)) / 1e6
        lines.append(f"{label:<{label_width}} |{bar}| {duration_ms:8.1f} ms{_flag(span)}")
    return "\n".join(lines)


def _tree_order(spans: Sequence[ReadableSpan]) -> list[tuple[int, ReadableSpan]]:
    """Depth-first, parents before children, siblings by start time."""
    by_key = {_key(span): span for span in spans}
    children: dict[_SpanKey | None, list[ReadableSpan]] = {}
    for span in spans:
        parent = _parent_key(span)
        children.setdefault(parent if parent in by_key else None, []).append(span)
    for siblings in children.values():
        siblings.sort(key=lambda span: (span.start_time, span.name))
    ordered: list[tuple[int, ReadableSpan]] = []
    seen: set[_SpanKey] = set()
    stack = [(0, span) for span in reversed(children.get(None, []))]
    # Each span is visited at most once, so the walk is bounded by len(spans).
    while stack:
        depth, span = stack.pop()
        if _key(span) in seen:
            continue
        seen.add(_key(span))
        ordered.append((depth, span))
        stack.extend((depth + 1, child) for child in reversed(children.get(_key(span), [])))
    return ordered


def _bar(start_ns: int, end_ns: int, total_ns: int, width: int) -> str:
    first = min(int(start_ns * width / total_ns), width - 1)
    last = min(max(math.ceil(end_ns * width / total_ns), first + 1), width)
    return " " * first + "#" * (last - first) + " " * (width - last)


def _header(spans: Sequence[ReadableSpan], total_ns: int) -> str:
    trace_ids = {span.context.trace_id for span in spans if span.context is not None}
    first = format_trace_id(min(trace_ids)) if trace_ids else "?"
    more = f" (+{len(trace_ids) - 1} other traces)" if len(trace_ids) > 1 else ""
    return f"trace {first}{more}  {total_ns / 1e6:.1f} ms  {len(spans)} spans"


def _label(depth: int, name: str) -> str:
    if len(name) > _MAX_LABEL_CHARS:
        name = name[: _MAX_LABEL_CHARS - 3] + "..."
    return _INDENT * depth + name


def _flag(span: ReadableSpan) -> str:
    # Client and server spans of one RPC share a name; the kind tells them apart.
    kind = f"  {span.kind.name.lower()}" if span.kind in (SpanKind.CLIENT, SpanKind.SERVER) else ""
    if span.end_time is None:
        return kind + "  (unfinished)"
    return kind + ("  ERROR" if span.status.status_code is StatusCode.ERROR else "")


def _start_ns(span: ReadableSpan) -> int:
    return span.start_time or 0  # only started spans are drawn


def _end_ns(span: ReadableSpan) -> int:
    # An unfinished span is drawn as an instant at its start rather than guessed at.
    return span.end_time if span.end_time is not None else _start_ns(span)


def _key(span: ReadableSpan) -> _SpanKey:
    return (
        (span.context.trace_id, span.context.span_id) if span.context is not None else (0, id(span))
    )


def _parent_key(span: ReadableSpan) -> _SpanKey | None:
    return (span.parent.trace_id, span.parent.span_id) if span.parent is not None else None
