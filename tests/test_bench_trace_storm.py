"""The trace-storm scenario's verdict on memory, and the stack setting it needs.

The scenario itself runs for minutes in ``make bench``; what a test can hold is that its
goal reads the server's RSS by the minute and fails a server whose memory grows, and that
its ceiling reaches the server's settings.
"""

from __future__ import annotations

from bench.harness.scenario import Scale
from bench.harness.stack import StackSpec
from bench.harness.stack_config import stack_config
from bench.harness.trace_storm import CEILING, CONNECTIONS, NAME, trace_storm
from service.settings.config import load_settings

WINDOW_S = 10.0
KEY = f"{NAME}/failing-ratio1/c{CONNECTIONS}"


def _verdict(rss_kib: list[int]) -> tuple[str, str]:
    result = {
        "window_s": WINDOW_S,
        "server_rss_kib": rss_kib,
        "reps": [{"replies_per_s": 100.0}] * len(rss_kib),
        "otlp_received": {"requests": 300, "bytes": 3_000_000},
    }
    goals = trace_storm(Scale(quick=False)).goals({KEY: result})
    return goals[0].verdict, goals[1].shown


def test_flat_memory_passes_and_memory_that_grows_by_the_minute_does_not() -> None:
    flat = [100_000 + (i % 3) * 50 for i in range(30)]
    assert _verdict(flat)[0] == "PASS"
    growing = [100_000 + i * 500 for i in range(30)]  # about 3 MiB a minute
    verdict, minutes = _verdict(growing)
    assert verdict == "GAP"
    assert len(minutes.split(", ")) == 5  # five whole minutes of ten-second windows


def test_the_storm_runs_with_its_ceiling_in_the_servers_settings(tmp_path) -> None:
    (config,) = trace_storm(Scale(quick=False)).configs
    assert config.spec.tail_max_per_s == CEILING and config.spec.http_fail_every == 1
    path = tmp_path / "bench.toml"
    path.write_text(
        stack_config(config.spec, "mongodb://127.0.0.1:1", "http://a", "http://m", "http://o")
    )
    assert load_settings(path, env={}).tracing.tail_max_per_s == CEILING
    as_shipped = StackSpec(server="fanout", tracing="ratio1")
    assert "tail_max_per_s" not in stack_config(
        as_shipped, "mongodb://127.0.0.1:1", "http://a", "http://m", "http://o"
    )
