"""``fanout trace-ui``: Fanout's traces in a real Zipkin UI, on loopback.

Starts a Zipkin server (:mod:`service.samples.zipkin_server`: Java 17, the jar from
Maven Central), the sample backends, and a Fanout server exporting its spans to
Zipkin (``tracing.exporter = "zipkin"``). A web tier of its own service name
(``web-tier``, a separate tracer provider) then makes two calls:

* ``whole``: every panel, within the server's ``fanout.request_deadline_ms``;
* ``cut``: a 1500 ms deadline, with the alerts service now answering after 2500 ms
  (and the alerts panel given 5000 ms), so the alerts task is cut by the deadline
  and marked so, while the other six finish well within it, even on a slow
  machine.

It prints both traces' URLs and the dependency graph's (``web-tier`` → ``fanout``
→ ``mongodb``, ``alerts``, ``metrics``), optionally saves screenshots of them
made with headless Chromium, and keeps Zipkin up until Ctrl-C (``--exit``: stop
at once).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import gevent
from opentelemetry.trace import TracerProvider

from lookups.clock import SYSTEM_CLOCK
from service.app import FanOutService
from service.client import AppStatsClient
from service.samples import DemoBackends
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from service.samples.zipkin_server import ZipkinServer, ZipkinUnavailable
from service.settings.config import load_settings
from tracing.settings import TracingSettings
from tracing.setup import configure_tracing

__all__ = ["TraceUiRun", "run_trace_ui", "record_traces", "screenshot"]

ALERTS_DELAY_MS = 2_500
CUT_DEADLINE_MS = 1_500
#: The alerts panel's budget and its service's read timeout: past the cut call's deadline,
#: so that the deadline is what cuts it.
ALERTS_TIMEOUT_MS = 5_000
_CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,1000",
    "--virtual-time-budget=10000",
)


@dataclass(frozen=True)
class TraceUiRun:
    """The traces one run left in Zipkin."""

    whole_trace_id: str
    cut_trace_id: str
    zipkin_url: str

    def trace_url(self, trace_id: str) -> str:
        return f"{self.zipkin_url}/zipkin/traces/{trace_id}"

    def dependencies_url(self) -> str:
        """The dependency graph of the last hour; the UI runs the query when both times are
        given."""
        end_ms = int(SYSTEM_CLOCK.wall() * 1000) + 60_000
        return (
            f"{self.zipkin_url}/zipkin/dependency?startTime={end_ms - 3_660_000}&endTime={end_ms}"
        )


def run_trace_ui(
    out: TextIO, *, zipkin_url: str = "", screenshots: Path | None = None, keep: bool = True
) -> int:
    """The command: 0 when both traces reached Zipkin, 1 otherwise (the reason printed).

    ``zipkin_url``: a Zipkin already running (its base URL); else one is started here.
    """
    try:
        with contextlib.ExitStack() as stack:
            if not zipkin_url:
                zipkin_url = stack.enter_context(ZipkinServer()).url
            out.write(f"Zipkin {zipkin_url}\n")
            run = record_traces(zipkin_url)
            _report(out, run, screenshots)
            if keep:
                out.write("Zipkin stays up until Ctrl-C.\n")
                out.flush()
                _wait_for_interrupt()
    except (ZipkinUnavailable, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        out.write(f"fanout trace-ui: {exc}\n")
        return 1
    return 0


def _report(out: TextIO, run: TraceUiRun, screenshots: Path | None) -> None:
    pages = (
        ("trace", run.trace_url(run.whole_trace_id)),
        ("trace-cut", run.trace_url(run.cut_trace_id)),
        ("dependencies", run.dependencies_url()),
    )
    labels = ("trace, every panel:", f"trace, alerts cut at {CUT_DEADLINE_MS} ms:", "dependencies:")
    width = max(map(len, labels))
    out.write("".join(f"  {label:<{width}} {url}\n" for label, (_, url) in zip(labels, pages)))
    out.flush()
    if screenshots is None:
        return
    for name, url in pages:
        out.write(f"  screenshot: {screenshot(url, screenshots / f'zipkin-{name}.png')}\n")


def record_traces(zipkin_url: str) -> TraceUiRun:
    """Serve the two calls with every span exported to Zipkin; wait until it has both traces.

    Installs the process's global tracer provider (service ``fanout``).
    """
    spans_endpoint = f"{zipkin_url.rstrip('/')}/api/v2/spans"
    with DemoBackends() as backends:
        settings = load_settings(
            None,
            env=os.environ,
            overrides={
                **backends.settings_overrides(),
                "server.port": 0,
                "tracing.exporter": "zipkin",
                "tracing.zipkin_endpoint": spans_endpoint,
                "tracing.service_name": "fanout",
                "lookups.alerts.timeout_ms": ALERTS_TIMEOUT_MS,
                "backends.alerts.read_timeout_ms": ALERTS_TIMEOUT_MS,
            },
        )
        server_tracing = configure_tracing(settings.tracing)
        web_tier = configure_tracing(
            TracingSettings(
                exporter="zipkin", service_name="web-tier", zipkin_endpoint=spans_endpoint
            ),
            set_global=False,
        )
        assert web_tier.provider is not None  # tracing is on: the exporter is set
        try:
            with FanOutService(settings) as service:
                deadline_ms = settings.fanout.request_deadline_ms
                whole = _call(service.address, web_tier.provider, deadline_ms)
                backends.http.alerts.delay_ms = ALERTS_DELAY_MS
                cut = _call(service.address, web_tier.provider, CUT_DEADLINE_MS)
        finally:
            web_tier.shutdown()
            server_tracing.shutdown()  # flushes the spans, the cut task's included
    run = TraceUiRun(whole, cut, zipkin_url.rstrip("/"))
    for trace_id in (whole, cut):
        _wait_for_trace(run.zipkin_url, trace_id)
    return run


def _call(address: tuple[str, int], provider: TracerProvider, deadline_ms: int) -> str:
    """One call from the web tier, in a span of its own: the trace's root."""
    host, port = address
    tracer = provider.get_tracer("fanout.trace_ui")
    with (
        AppStatsClient(host, port, tracer_provider=provider) as client,
        tracer.start_as_current_span("render dashboard"),
    ):
        response = client.get_app_stats(
            "shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=deadline_ms
        )
    return str(response.trace_id)


def _wait_for_trace(zipkin_url: str, trace_id: str, timeout_s: float = 30.0) -> None:
    until = SYSTEM_CLOCK.monotonic() + timeout_s
    while SYSTEM_CLOCK.monotonic() < until:
        try:
            with urllib.request.urlopen(
                f"{zipkin_url}/api/v2/trace/{trace_id}", timeout=5
            ) as answer:
                if json.loads(answer.read()):
                    return
        except OSError:
            pass
        gevent.sleep(0.3)
    raise RuntimeError(f"trace {trace_id} did not reach Zipkin within {timeout_s:.0f} s")


def screenshot(url: str, path: Path) -> Path:
    """A PNG of ``url`` rendered by headless Chromium (``chromium`` on PATH)."""
    browser = (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )
    if browser is None:
        raise RuntimeError("screenshots need Chromium on PATH (apt-get install chromium)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fanout-chromium-") as profile:
        subprocess.run(
            [
                browser,
                *_CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--screenshot={path.resolve()}",
                url,
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
    return path


def _wait_for_interrupt() -> None:
    try:
        while True:
            gevent.sleep(3600)
    except KeyboardInterrupt:
        pass
