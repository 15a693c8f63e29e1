"""render_waterfall on real SDK spans taken from the session's in-memory exporter."""

from __future__ import annotations

import re
from typing import Any

import gevent
import pytest
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from tracing.context import spawn_in_context
from tracing.spans import request_span, task_span
from tracing.waterfall import render_waterfall

LINE = re.compile(r"^(?P<label>.*?) +\|(?P<bar>[ #]*)\| +(?P<ms>[\d.]+) ms(?P<flag>.*)$")
MS = 1_000_000
PANELS = ("errors", "urls", "controllers", "queries", "alerts", "latency", "volume")


def parse(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines()[1:]:
        match = LINE.match(line)
        assert match, line
        bar = match["bar"]
        rows.append(
            {
                "label": match["label"],
                "name": match["label"].strip(),
                "depth": (len(match["label"]) - len(match["label"].lstrip())) // 2,
                "first": bar.index("#"),
                "last": bar.rindex("#"),
                "width": len(bar),
                "ms": float(match["ms"]),
                "flag": match["flag"].strip(),
            }
        )
    return rows


def span_at(name: str, start_ms: float, end_ms: float, parent: Span | None = None) -> Span:
    base = 1_700_000_000_000 * MS
    context = trace.set_span_in_context(parent) if parent is not None else None
    span = trace.get_tracer("test").start_span(
        name, context=context, start_time=base + int(start_ms * MS)
    )
    span.end(end_time=base + int(end_ms * MS))
    return span


def test_tree_order_indentation_and_exact_placement(spans) -> None:
    root = span_at("AppStats/getStats", 0, 100)
    late = span_at("fanout.task late", 50, 100, parent=root)
    early = span_at("fanout.task early", 0, 25, parent=root)
    span_at("GET", 60, 80, parent=late)
    rows = parse(render_waterfall(spans.get_finished_spans(), width=20))
    assert [(row["name"], row["depth"]) for row in rows] == [
        ("AppStats/getStats", 0),
        ("fanout.task early", 1),
        ("fanout.task late", 1),
        ("GET", 2),
    ]
    assert [(row["first"], row["last"]) for row in rows] == [(0, 19), (0, 4), (10, 19), (12, 15)]
    assert [row["ms"] for row in rows] == [100.0, 25.0, 50.0, 20.0]
    assert all(row["width"] == 20 for row in rows)
    assert early.get_span_context().trace_id == root.get_span_context().trace_id


def test_spans_whose_parent_is_missing_are_roots(spans) -> None:
    root = span_at("AppStats/getStats", 0, 10)
    span_at("fanout.task errors", 1, 9, parent=root)
    orphans = [span for span in spans.get_finished_spans() if span.name != "AppStats/getStats"]
    rows = parse(render_waterfall(orphans))
    assert [(row["name"], row["depth"]) for row in rows] == [("fanout.task errors", 0)]


def test_error_spans_are_flagged_and_header_names_the_trace(spans) -> None:
    root = span_at("AppStats/getStats", 0, 10)
    under_root = trace.set_span_in_context(root)
    failed = trace.get_tracer("test").start_span("fanout.task alerts", context=under_root)
    failed.set_status(Status(StatusCode.ERROR, "boom"))
    failed.end()
    text = render_waterfall(spans.get_finished_spans())
    assert text.splitlines()[0].startswith(f"trace {root.get_span_context().trace_id:032x}")
    assert [row["flag"] for row in parse(text)] == ["", "ERROR"]


def run_request(spawn_all: bool) -> None:
    def lookup(name: str) -> None:
        with task_span(name, "http", 0):
            gevent.sleep(0.05)

    with request_span("getStats", {}, "req-waterfall"):
        if spawn_all:
            gevent.joinall(
                [spawn_in_context(lookup, name) for name in PANELS], timeout=10, raise_error=True
            )
        else:
            for name in PANELS:
                lookup(name)


def overlap(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """The columns every bar covers: (first, last); first > last when they do not all overlap."""
    return max(row["first"] for row in rows), min(row["last"] for row in rows)


def test_parallel_tasks_visibly_overlap(spans) -> None:
    run_request(spawn_all=True)
    text = render_waterfall(spans.get_finished_spans(), width=50)
    tasks = [row for row in parse(text) if row["name"].startswith("fanout.task")]
    assert len(tasks) == len(PANELS), text
    first, last = overlap(tasks)
    assert first <= last, text
    # Seven 50 ms sleeps in parallel: each bar spans most of the request, none is a sliver.
    assert all(row["last"] - row["first"] >= 25 for row in tasks), text


def test_sequential_tasks_do_not_overlap(spans) -> None:
    run_request(spawn_all=False)
    text = render_waterfall(spans.get_finished_spans(), width=70)
    tasks = [row for row in parse(text) if row["name"].startswith("fanout.task")]
    first, last = overlap(tasks)
    assert first > last, text


def test_empty_input_and_bad_width(spans) -> None:
    assert render_waterfall([]) == ""
    with pytest.raises(ValueError):
        render_waterfall([], width=0)


def test_width_one_and_zero_length_spans(spans) -> None:
    span_at("instant", 5, 5)
    rows = parse(render_waterfall(spans.get_finished_spans(), width=1))
    assert rows == [
        {
            "label": "instant",
            "name": "instant",
            "depth": 0,
            "first": 0,
            "last": 0,
            "width": 1,
            "ms": 0.0,
            "flag": "",
        }
    ]
