"""Secrets (the password in ``mongo.uri``, ``http.auth_token``) never reach logs, spans or callers.

Every lookup fails here (MongoDB down, HTTP 500, HTTP refused), the paths most likely to
quote a URI or a header in a message, with all logging at DEBUG: in process (caplog and
the finished spans) and as a real ``fanout serve --log-level debug`` process whose
secrets arrive through ``FANOUT_*`` variables and whose spans go to the console.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest

from lookups.redact import redact_uri
from service.app import FanOutService
from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData
from service.samples.faults import FaultyHttpService
from service.settings.config import ConfigError, load_settings
from tests.support.sockets import dead_port

PASSWORD = "s3cr3t-pw"
TOKEN = "tok-s3cr3t"
SECRETS = (PASSWORD, TOKEN)
Status = appstats.TaskStatus


def leaked(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


@pytest.fixture
def guarded_http(sample_data: SampleData) -> Iterator[FaultyHttpService]:
    """An alerts service that answers 500, but only to callers holding the token (401 otherwise)."""
    with FaultyHttpService(sample_data, auth_token=TOKEN) as http:
        http.set_mode("error500")
        yield http


@pytest.fixture
def secret_settings(guarded_http: FaultyHttpService) -> dict[str, str]:
    return {
        "mongo.uri": f"mongodb://user:{PASSWORD}@127.0.0.1:{dead_port()}/?authSource=admin",
        "http.auth_token": TOKEN,
        "http.alerts_url": guarded_http.url,
        "http.metrics_url": f"http://127.0.0.1:{dead_port()}",
        # Every panel fails at once (a dead port, a 500); the budget only has to outlast a
        # busy machine's answer: at 600 ms, and again at 1500 ms (its event loop blocked
        # for 580 ms), a stressed run saw the panels cut instead. Within the client's 5 s.
        "fanout.task_timeout_ms": "4000",
        "fanout.request_deadline_ms": "4500",
    }


def assert_failed_as_expected(outcomes: list[Any]) -> None:
    by_name = {o.name: o for o in outcomes}
    assert {by_name[n].error_type for n in ("errors", "urls", "controllers", "queries")} <= {
        "BackendUnavailable",
        "CANCELLED",
    }
    assert by_name["alerts"].error_type == "BackendUnavailable"
    assert "HTTP 500" in by_name["alerts"].message  # 500, not 401: the token was sent
    assert by_name["latency"].status in (Status.ERROR, Status.CANCELLED)


def span_texts(spans: Any) -> list[str]:
    """Every finished span as JSON: name, attributes, events, links, status description."""
    return [span.to_json() for span in spans.get_finished_spans()]


def test_secrets_stay_out_of_logs_spans_and_answers(
    caplog: pytest.LogCaptureFixture, spans: Any, secret_settings: dict[str, str]
) -> None:
    caplog.set_level(logging.DEBUG)
    answers: list[str] = []
    for required in (False, True):
        overrides = {**secret_settings, "server.port": 0, "lookups.errors.required": required}
        service = FanOutService(load_settings(env={}, overrides=overrides)).start()
        try:
            with AppStatsClient(*service.address, timeout_ms=5000) as client:
                if required:
                    with pytest.raises(appstats.PanelFailed) as caught:
                        client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                    outcomes, answer = caught.value.outcomes, caught.value
                else:
                    answer = client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
                    outcomes = answer.outcomes
                assert_failed_as_expected(outcomes)
                answers += [repr(answer), str(answer), repr(client.health())]
        finally:
            service.stop()

    logs, finished = caplog.text, span_texts(spans)
    assert leaked(logs) == []
    assert [leaked(text) for text in finished if leaked(text)] == []
    assert [leaked(text) for text in answers if leaked(text)] == []
    # What was searched holds what could have leaked: debug logs, library logs, failed spans.
    assert redact_uri(secret_settings["mongo.uri"]) in logs
    assert any(r.name.startswith("pymongo") for r in caplog.records)
    assert any('"fanout.task.status": "ERROR"' in text for text in finished)


def wait_for_port(out_path: Path, server: subprocess.Popen[Any], timeout_s: float = 30) -> int:
    """The port from the server's "serving on host:port" line (written to ``out_path``)."""
    ends = time.monotonic() + timeout_s
    while time.monotonic() < ends and server.poll() is None:
        for line in out_path.read_text().splitlines():
            if "serving on" in line:
                return int(line.rsplit(":", 1)[1])
        gevent.sleep(0.05)
    raise AssertionError(f"the server did not start: {out_path.read_text()}")


def test_fanout_serve_at_debug_level_never_prints_secrets(
    tmp_path: Path, secret_settings: dict[str, str]
) -> None:
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "none",
        "FANOUT_TRACING_EXPORTER": "console",
        **{
            "FANOUT_" + key.upper().replace(".", "_"): value
            for key, value in secret_settings.items()
        },
    }
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # Files, not pipes: debug logging writes more than a pipe holds while nobody reads it.
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "--log-level", "debug", "serve", "--port", "0"],
            stdout=out_file,
            stderr=err_file,
            env=env,
        )
    try:
        port = wait_for_port(out_path, server)
        with AppStatsClient("127.0.0.1", port, timeout_ms=5000) as client:
            assert_failed_as_expected(
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS).outcomes
            )
            client.health()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, err_path.read_text()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    out, err = out_path.read_text(), err_path.read_text()
    assert leaked(out) == [] and leaked(err) == []
    assert "DEBUG" in err and redact_uri(secret_settings["mongo.uri"]) in err
    assert '"name": "fanout.task alerts"' in out  # the spans were printed


@pytest.mark.parametrize(
    "uri, shown",
    [
        (
            f"mongodb://user:{PASSWORD}@db-1:27017,db-2/?replicaSet=rs0",
            "mongodb://***@db-1:27017,db-2/?replicaSet=rs0",
        ),
        (
            f"mongodb+srv://us%40er:{PASSWORD}@cluster.example/apm",
            "mongodb+srv://***@cluster.example/apm",
        ),
        (
            f"mongodb://db/?authMechanismProperties=AWS_SESSION_TOKEN:{TOKEN}&w=1",
            "mongodb://db/?authMechanismProperties=***&w=1",
        ),
        ("mongodb://127.0.0.1:27017", "mongodb://127.0.0.1:27017"),
    ],
)
def test_redact_uri_hides_credentials_and_keeps_hosts(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


@pytest.mark.parametrize(
    "token", [f"{TOKEN} x", f"{TOKEN}\tx", f"{TOKEN}\u00e9", f"{TOKEN}\r\nX-Evil: 1"]
)
def test_a_token_that_is_not_a_bearer_token_is_refused_without_quoting_it(token: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(env={}, overrides={"http.auth_token": token})
    assert "http.auth_token" in str(caught.value) and leaked(str(caught.value)) == []
