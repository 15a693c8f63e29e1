"""``fanout demo``: the whole path in one command, on embedded backends.

Starts the sample backends (a seeded MongoDB-wire server, the alerts and
metrics HTTP services), a Fanout server on them, calls ``get_app_stats`` the
way a web tier would, prints panels, outcomes and a waterfall of the trace,
and stops everything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.app import FanOutService
from service.cli.report import format_response, status_name
from service.client import AppStatsClient
from service.idl import appstats
from service.samples import DemoBackends
from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS
from service.settings.config import Settings, as_config_error, load_settings
from tracing.setup import configure_tracing
from tracing.waterfall import render_waterfall

__all__ = ["run_demo"]


def run_demo(
    out: TextIO,
    app: str = "shop",
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run the demo, writing to ``out``. Returns 0 when every panel came back OK, else 1."""
    env = os.environ if env is None else env
    collected = InMemorySpanExporter()
    with DemoBackends() as backends:
        settings = _demo_settings(backends.settings_overrides(), config_path, env)
        with as_config_error():
            tracing = configure_tracing(
                settings.tracing, extra_processors=[SimpleSpanProcessor(collected)]
            )
        try:
            with FanOutService(settings) as service:
                host, port = service.address
                _print_setup(out, backends.settings_overrides(), host, port, settings)
                response = _call(host, port, settings, app)
        finally:
            tracing.shutdown()
    out.write(format_response(response) + "\n\nTrace\n")
    ours = [
        s
        for s in collected.get_finished_spans()
        if format(s.context.trace_id, "032x") == response.trace_id
    ]
    out.write(render_waterfall(ours) + "\n")
    failed = [o.name for o in response.outcomes if status_name(o.status) != "OK"]
    if failed:
        out.write(f"\npanels not gathered: {', '.join(failed)}\n")
    return 1 if failed else 0


def _demo_settings(
    backend_overrides: Mapping[str, str], config_path: str | None, env: Mapping[str, str]
) -> Settings:
    overrides: dict[str, object] = {**backend_overrides, "server.port": 0}
    settings = load_settings(config_path, env=env, overrides=overrides)
    if not settings.tracing.exporter and "OTEL_TRACES_EXPORTER" not in env:
        # The demo prints its own trace; export elsewhere only when asked to.
        settings = load_settings(
            config_path, env=env, overrides={**overrides, "tracing.exporter": "none"}
        )
    return settings


def _print_setup(
    out: TextIO, backends: Mapping[str, str], host: str, port: int, settings: Settings
) -> None:
    out.write("Fanout demo\n")
    out.write(
        f"  MongoDB-wire server  {backends['backends.mongo.uri']} (nx-27017, seeded, "
        f"database {backends['backends.mongo.database']})\n"
    )
    out.write(f"  alerts service       {backends['backends.alerts.url']}\n")
    out.write(f"  metrics service      {backends['backends.metrics.url']}\n")
    out.write(
        f"  Thrift server        {host}:{port} ({settings.server.transport} transport, "
        f"{settings.server.protocol} protocol)\n\n"
    )


def _call(host: str, port: int, settings: Settings, app: str) -> appstats.StatsResponse:
    tracer = trace.get_tracer("fanout.demo")
    with (
        AppStatsClient(
            host, port, transport=settings.server.transport, protocol=settings.server.protocol
        ) as client,
        tracer.start_as_current_span("web-tier render dashboard"),
    ):
        return client.get_app_stats(
            app, SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=settings.fanout.request_deadline_ms
        )
