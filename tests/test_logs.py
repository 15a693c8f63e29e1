"""Logs a platform can read: JSON lines carrying the call's trace, span and request ids."""

from __future__ import annotations

import datetime
import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from service.client import AppStatsClient
from service.operations.logs import LoggingSettings, configure_logging, set_request_id, set_worker
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.sockets import dead_port


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Give the root logger back as it was (pytest's own capture handlers included)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_lines_carry_the_trace_span_and_request_ids(root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging(LoggingSettings(format="json"), "info", stream=stream)
    tracer = TracerProvider().get_tracer("test")
    logging.getLogger("outside").info("before any call")
    with tracer.start_as_current_span("call") as span:
        set_request_id("web-42")
        logging.getLogger("service.test").warning("inside %s", "a call")
    outside, inside = json_lines(stream.getvalue())
    context = span.get_span_context()
    assert inside["message"] == "inside a call" and inside["level"] == "WARNING"
    assert inside["logger"] == "service.test" and inside["time"]
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
    assert inside["request_id"] == "web-42"
    assert outside["trace_id"] == "0" and outside["message"] == "before any call"


def test_json_time_is_rfc_3339_in_utc(root_logging: None) -> None:
    """Log platforms read a zone-less ``2026-12-07 01:35:45,272`` as their own local time."""
    stream = io.StringIO()
    configure_logging(LoggingSettings(format="json"), "info", stream=stream)
    before = datetime.datetime.now(datetime.UTC)
    logging.getLogger("service.test").info("now")
    (line,) = json_lines(stream.getvalue())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]), line["time"]
    logged = datetime.datetime.fromisoformat(line["time"])
    assert abs((logged - before).total_seconds()) < 60  # UTC, not the machine's zone


def test_text_stays_the_default_format(root_logging: None) -> None:
    stream = io.StringIO()
    configure_logging(LoggingSettings(), "info", stream=stream)
    logging.getLogger("service.test").info("plain")
    line = stream.getvalue().strip()
    assert line.endswith("INFO service.test: plain") and not line.startswith("{")


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_workers_lines_name_the_worker(root_logging: None, log_format: str) -> None:
    stream = io.StringIO()
    configure_logging(LoggingSettings(format=log_format), "info", stream=stream)
    try:
        logging.getLogger("service.test").info("alone")
        set_worker("1")
        logging.getLogger("service.test").info("in a worker")
    finally:
        set_worker("")
    alone, worker = stream.getvalue().splitlines()
    if log_format == "json":
        assert json.loads(alone)["worker"] == "" and json.loads(worker)["worker"] == "1"
    else:
        assert alone.endswith("INFO service.test: alone")
        assert worker.endswith("INFO worker 1: service.test: in a worker")


def test_fanout_serve_logs_json_lines_of_a_call_with_its_ids(
    serve: Any, http_services: Any
) -> None:
    server = serve(
        http_services,
        **{
            "logging.format": "json",
            "fanout.task_timeout_ms": 2000,
            "fanout.request_deadline_ms": 3000,
            "mongo.uri": f"mongodb://127.0.0.1:{dead_port()}",
            "mongo.breaker_failures": 1,
        },
    )
    with AppStatsClient("127.0.0.1", server.port, timeout_ms=5000) as client:
        response = client.get_app_stats(
            "shop", SAMPLE_START_MS, SAMPLE_END_MS, ["errors"], request_id="web-42"
        )
    assert response.outcomes[0].error_type == "BackendUnavailable"
    lines = json_lines(server.log())
    fields = {"time", "level", "logger", "message", "trace_id", "span_id", "request_id", "worker"}
    assert lines and all(set(line) == fields for line in lines), lines[:3]  # each field once
    assert json.loads(server.first_line)["message"].startswith("serving on 127.0.0.1:")
    opened = [line for line in lines if "circuit mongo: closed -> open" in line["message"]]
    assert len(opened) == 1, lines
    assert opened[0]["trace_id"] == response.trace_id
    assert opened[0]["request_id"] == "web-42" and opened[0]["span_id"] != "0"


@pytest.mark.parametrize("asked_by", ["variable", "file", "neither"])
def test_a_configuration_error_is_a_json_line_when_the_log_is_json(
    tmp_path: Any, asked_by: str
) -> None:
    """A log platform reading a JSON log gets the error that stopped the start as JSON too."""
    import os
    import subprocess
    import sys

    config = tmp_path / "fanout.toml"
    logging_section = '[logging]\nformat = "json"\n' if asked_by == "file" else ""
    config.write_text(f"{logging_section}[server]\nport = 99999\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FANOUT_")}
    if asked_by == "variable":
        env["FANOUT_LOGGING_FORMAT"] = "json"
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    if asked_by == "neither":
        assert done.stderr.startswith("fanout: configuration error: "), done.stderr
        assert "port" in done.stderr
        return
    [text] = [text for text in done.stderr.splitlines() if text.strip()]  # JSON only
    line = json.loads(text)
    assert line["level"] == "ERROR" and line["message"].startswith("configuration error: ")
    assert "port" in line["message"], line
