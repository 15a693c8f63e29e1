"""A worker's calls kept in a file of its own: read back as written, and written out by the
master as the OpenTelemetry Prometheus exporter writes the same calls."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.semconv._incubating.metrics.rpc_metrics import create_rpc_server_call_duration
from prometheus_client import CollectorRegistry, generate_latest

from service.workers.exposition import Exposition, parse_exposition
from service.workers.kept_calls import CALLS, with_kept_calls
from tracing.call_tally import KEY_BYTES, SLOTS, CallTally, read_call_tally
from tracing.metrics import seconds_views
from tracing.spans import rpc_attributes

GET = "AppStats/get_app_stats"


def test_the_calls_read_back_by_method_and_error_type_in_their_buckets(tmp_path: Path) -> None:
    tally = CallTally(tmp_path / "calls")
    for seconds in (0.0005, 0.001, 0.02, 30.0):
        tally.add(GET, "", seconds)
    tally.add(GET, "Overloaded", 0.002)
    answered, refused = read_call_tally(tmp_path / "calls")
    assert (answered.method, answered.error_type, answered.count) == (GET, "", 4)
    # A bound is its bucket's own (le): 1 ms falls in the first; 30 s above every bound.
    assert answered.buckets[0] == 2 and answered.buckets[4] == 1 and answered.buckets[-1] == 1
    assert answered.seconds == 0.0005 + 0.001 + 0.02 + 30.0
    assert (refused.error_type, refused.count, refused.buckets[1]) == ("Overloaded", 1, 1)


def test_a_missing_or_foreign_file_holds_no_calls(tmp_path: Path) -> None:
    assert read_call_tally(tmp_path / "none") == []
    (tmp_path / "short").write_bytes(b"FNCT")
    assert read_call_tally(tmp_path / "short") == []
    tally = CallTally(tmp_path / "calls")
    tally.add(GET, "", 0.01)
    data = bytearray((tmp_path / "calls").read_bytes())
    data[8] += 1  # another count of bucket bounds: another layout
    (tmp_path / "other").write_bytes(bytes(data))
    assert read_call_tally(tmp_path / "other") == []


def test_keys_past_the_last_slot_or_too_long_are_not_kept(tmp_path: Path) -> None:
    tally = CallTally(tmp_path / "calls")
    tally.add(GET, "E" * KEY_BYTES, 0.01)
    for number in range(SLOTS + 5):
        tally.add(GET, f"Error{number}", 0.01)
    kept = read_call_tally(tmp_path / "calls")
    assert len(kept) == SLOTS and kept[-1].error_type == f"Error{SLOTS - 1}"


def _exporter() -> tuple[CollectorRegistry, MeterProvider]:
    """The exporter as ``tracing.metrics`` sets it up, on a registry of the test's own."""
    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(
        metric_readers=[PrometheusMetricReader(registry=registry)],
        views=seconds_views(),
        resource=Resource.create({}),
    )
    return registry, provider


def test_a_gone_workers_calls_are_written_as_the_exporter_writes_them(tmp_path: Path) -> None:
    registry, provider = _exporter()
    histogram = create_rpc_server_call_duration(provider.get_meter("fanout.server"))
    tally = CallTally(tmp_path / "calls")

    def call(method: str, error_type: str, seconds: float) -> None:
        attributes = rpc_attributes(method)
        if error_type:
            attributes["error.type"] = error_type
        tally.add(attributes["rpc.method"], error_type, seconds)
        histogram.record(seconds, attributes)

    try:
        call("get_app_stats", "", 0.02)
        call("ping", "", 0.0001)
        last_scrape = parse_exposition(generate_latest(registry).decode())
        # After the master's last scrape: more answers, and the first refusal, whose series
        # has a label (error_type) the scrape's had not.
        call("get_app_stats", "", 0.3)
        call("get_app_stats", "Overloaded", 0.002)
        final = parse_exposition(generate_latest(registry).decode())
    finally:
        provider.shutdown()
    assert "error_type" not in str(last_scrape.samples[CALLS])
    kept = with_kept_calls(last_scrape, read_call_tally(tmp_path / "calls"), [])
    assert kept.samples[CALLS] == final.samples[CALLS]
    assert kept.families[CALLS] == final.families[CALLS]
    assert last_scrape.samples[CALLS] != final.samples[CALLS]  # the scrape was left as it was


def test_without_a_series_to_write_them_like_the_calls_borrow_anothers(tmp_path: Path) -> None:
    tally = CallTally(tmp_path / "calls")
    tally.add(GET, "", 0.02)
    kept = read_call_tally(tmp_path / "calls")
    assert with_kept_calls(Exposition(), kept, []).samples == {}  # nothing to write them like
    other = parse_exposition(
        f"# TYPE {CALLS} histogram\n"
        f'{CALLS}_count{{otel_scope_name="fanout.server",rpc_method="{GET}"}} 7.0\n'
    )
    written = with_kept_calls(Exposition(), kept, [other]).samples[CALLS]
    assert written[f'{CALLS}_count{{otel_scope_name="fanout.server",rpc_method="{GET}"}}'] == 1.0
    assert (
        written[f'{CALLS}_bucket{{le="+Inf",otel_scope_name="fanout.server",rpc_method="{GET}"}}']
        == 1.0
    )
