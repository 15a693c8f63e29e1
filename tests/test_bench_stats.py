"""The benchmark's pure functions: intervals, percentiles, bootstrap ratios,
goal verdicts and the cheap reading of Thrift replies the load generator relies on."""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest
from thriftpy2.protocol import TBinaryProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TMemoryBuffer

from bench.analysis import stats
from bench.analysis.goals import failures_goal, ratio_goal, value_goal
from bench.load import frames
from service.idl import appstats


def test_mean_ci_is_the_student_interval() -> None:
    values = [10.0, 12.0, 11.0, 13.0, 9.0]
    estimate = stats.mean_ci(values)
    half = 2.776 * statistics.stdev(values) / math.sqrt(len(values))
    assert estimate.value == pytest.approx(11.0)
    assert estimate.low == pytest.approx(11.0 - half, abs=1e-3)
    assert estimate.high == pytest.approx(11.0 + half, abs=1e-3)
    assert estimate.n == 5


def test_mean_ci_of_one_value_has_no_width_and_of_none_raises() -> None:
    assert stats.mean_ci([4.0]) == stats.Estimate(4.0, 4.0, 4.0, 1)
    with pytest.raises(ValueError):
        stats.mean_ci([])


def test_mean_ci_covers_the_true_mean_about_95_percent_of_the_time() -> None:
    rng = random.Random(7)
    trials = 400
    covered = 0
    for _ in range(trials):
        estimate = stats.mean_ci([rng.gauss(100.0, 15.0) for _ in range(10)])
        covered += estimate.low <= 100.0 <= estimate.high
    assert 0.91 <= covered / trials <= 0.99


def test_percentile_interpolates_like_numpy() -> None:
    values = sorted([15.0, 20.0, 35.0, 40.0, 50.0])
    assert stats.percentile(values, 0) == 15.0
    assert stats.percentile(values, 100) == 50.0
    assert stats.percentile(values, 50) == 35.0
    assert stats.percentile(values, 40) == pytest.approx(29.0)  # numpy.percentile: 29.0
    assert stats.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile(values, 101)


def test_bootstrap_ratio_brackets_the_ratio_and_is_reproducible() -> None:
    rng = random.Random(3)
    top = [rng.gauss(300.0, 10.0) for _ in range(30)]
    bottom = [rng.gauss(100.0, 5.0) for _ in range(30)]
    estimate = stats.bootstrap_ratio(top, bottom)
    assert estimate.value == pytest.approx(stats.ratio_of_means(top, bottom))
    assert estimate.low < estimate.value < estimate.high
    assert estimate.low > 2.8 and estimate.high < 3.2
    assert stats.bootstrap_ratio(top, bottom) == estimate
    with pytest.raises(ValueError):
        stats.bootstrap_ratio([], bottom)


def test_bootstrap_ratio_interval_narrows_with_less_noise() -> None:
    rng = random.Random(5)
    noisy = stats.bootstrap_ratio([rng.gauss(2.0, 0.5) for _ in range(30)], [1.0] * 30)
    quiet = stats.bootstrap_ratio([rng.gauss(2.0, 0.05) for _ in range(30)], [1.0] * 30)
    assert quiet.high - quiet.low < noisy.high - noisy.low


def test_ratio_goal_verdicts() -> None:
    fast, slow = [30.0, 31.0, 29.0, 30.5], [10.0, 10.2, 9.8, 10.1]
    assert ratio_goal("s", "x", fast, slow, limit=2.0, at_most=False).verdict == "PASS"
    assert ratio_goal("s", "x", fast, slow, limit=4.0, at_most=False).verdict == "GAP"
    assert ratio_goal("s", "x", slow, fast, limit=0.5, at_most=True).verdict == "PASS"
    assert ratio_goal("s", "x", fast, slow, limit=None, at_most=True).verdict == "INFO"
    assert ratio_goal("s", "x", [], slow, limit=2.0, at_most=False).verdict == "ERROR"
    close = ratio_goal(
        "s", "x", [1.0, 1.3, 0.7, 1.1], [1.0, 1.0, 1.0, 1.0], limit=1.0, at_most=True
    )
    assert "uncertain" in close.note


def test_failures_goal_counts_every_kind() -> None:
    clean = {"failures_total": {}, "degraded_total": 2, "reps": [{"ok": 5, "degraded": 2}]}
    broken = {
        "failures_total": {"timeout": 2, "transport": 1},
        "degraded_total": 0,
        "reps": [{"ok": 5, "degraded": 0}],
    }
    assert failures_goal("s", "x", clean).verdict == "PASS"
    goal = failures_goal("s", "x", broken)
    assert (goal.verdict, goal.shown) == ("GAP", "3")
    assert "timeout 2" in goal.note
    assert failures_goal("s", "x", {"error": "boom"}).verdict == "ERROR"


def test_value_goal_against_an_upper_limit() -> None:
    assert value_goal("m", "x", stats.Estimate(20.0, 18.0, 22.0, 30), "us", 25.0).verdict == "PASS"
    assert value_goal("m", "x", stats.Estimate(30.0, 30.0, 30.0, 1), "us", 25.0).verdict == "GAP"
    assert value_goal("m", "x", None, "us", 25.0).verdict == "ERROR"


# ---- reading replies without decoding them ------------------------------------------------------


def _reply(
    method: str, result: Any, message_type: int = TMessageType.REPLY, strict: bool = True
) -> bytes:
    buffer = TMemoryBuffer()
    protocol = TBinaryProtocol(buffer, strict_write=strict)
    protocol.write_message_begin(method, message_type, 7)
    result.write(protocol)
    protocol.write_message_end()
    return buffer.getvalue()


def _stats_reply(statuses: list[int]) -> bytes:
    outcomes = [
        appstats.TaskOutcome(
            name=f"p{i}", source="mongo", status=s, elapsed_ms=20.25, retryable=False
        )
        for i, s in enumerate(statuses)
    ]
    response = appstats.StatsResponse(
        app="shop", panels={}, outcomes=outcomes, trace_id="", elapsed_ms=21.5
    )
    return _reply("get_app_stats", appstats.AppStats.get_app_stats_result(success=response))


def test_classify_reply_success_and_degraded() -> None:
    names = frames.exception_names("get_app_stats")
    assert frames.classify_reply(_stats_reply([0] * 7), 7, names) == "ok"
    assert frames.classify_reply(_stats_reply([0] * 6 + [2]), 7, names) == "degraded"
    assert frames.classify_reply(_stats_reply([0] * 6 + [2]), 0, names) == "ok"
    ping = _reply("ping", appstats.AppStats.ping_result(success="pong"))
    assert frames.classify_reply(ping) == "ok"
    assert (
        frames.classify_reply(
            _reply("ping", appstats.AppStats.ping_result(success="pong"), strict=False)
        )
        == "ok"
    )


def test_classify_reply_exceptions_and_garbage() -> None:
    names = frames.exception_names("get_app_stats")
    assert names == {1: "invalid", 2: "overloaded", 3: "failed"}
    overloaded = appstats.AppStats.get_app_stats_result(overloaded=appstats.Overloaded("busy"))
    assert frames.classify_reply(_reply("get_app_stats", overloaded), 7, names) == "overloaded"
    assert frames.classify_reply(_reply("get_app_stats", overloaded)) == "exception_2"
    internal = TApplicationException(TApplicationException.INTERNAL_ERROR, "boom")
    exception = _reply("ping", internal, TMessageType.EXCEPTION)
    assert frames.classify_reply(exception) == "app_exception"
    assert frames.classify_reply(b"\x80\x01") == "bad_reply"
    assert frames.classify_reply(b"\x80\x01\x00\x02\x00\x00\x00\x40ping") == "bad_reply"


def test_encoded_call_is_one_framed_message_the_server_can_decode() -> None:
    frame = frames.stats_frame("shop", 1, 2, ["errors"], deadline_ms=500)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    protocol = TBinaryProtocol(TMemoryBuffer(frame[4:]))
    name, message_type, _ = protocol.read_message_begin()
    args = appstats.AppStats.get_app_stats_args()
    args.read(protocol)
    assert (name, message_type) == ("get_app_stats", TMessageType.CALL)
    assert (args.request.app, args.request.panels, args.request.meta.deadline_ms) == (
        "shop",
        ["errors"],
        500,
    )


def test_zipf_viewers_watch_twenty_dashboards_by_popularity() -> None:
    from collections import Counter

    from bench.harness.calls import ZIPF_DASHBOARDS, zipf_views

    views = zipf_views(200)
    assert len(views) == 200
    by_dashboard = Counter(views)
    assert len(by_dashboard) == ZIPF_DASHBOARDS  # every dashboard has a viewer
    counts = [by_dashboard[view] for view in dict.fromkeys(views)]  # in rank order
    assert counts == sorted(counts, reverse=True) and counts[0] == 56 and counts[-1] >= 1
    assert counts[0] / counts[1] == pytest.approx(2, rel=0.05)  # 1/k: the top one twice the next
    assert {view[0] for view in views} == {"shop"}
    assert len({(view[1], view[2]) for view in views}) == ZIPF_DASHBOARDS


def test_a_rate_relative_to_capacity_becomes_each_connections_interval() -> None:
    from bench.harness.runner import Config, at_capacity_fraction

    config = Config(
        key="latency/open-90/c50",
        scenario="latency",
        label="open-90",
        spec=None,
        call="stats",
        connections=50,
        open_loop=True,
        capacity_fraction=0.9,
        capacity_of="latency/capacity/c50",
    )
    probe = {"key": "latency/capacity/c50", "reps": [{"rps": 80.0}, {"rps": 120.0}]}
    paced = at_capacity_fraction(config, [probe])
    assert paced.interval_s == pytest.approx(50 / (0.9 * 100.0))  # 90 calls/s over 50 connections
    with pytest.raises(ValueError, match="no capacity measured"):
        at_capacity_fraction(config, [{"key": "latency/capacity/c50", "reps": [{"rps": 0.0}]}])
    closed = Config(key="k", scenario="s", label="l", spec=None, call="stats", connections=5)
    assert at_capacity_fraction(closed, []) is closed


def test_the_cpu_of_one_refusal_is_pooled_over_windows_of_very_different_counts() -> None:
    """Callers held together come back together: a window with a dozen refusals must not
    weigh as much as one with a thousand (the mean of per-window ratios would say 0.53 ms)."""
    from bench.harness.overload import _refusal_cpu_ms

    def rep(refused: int, answered: int, cpu_pct: float) -> dict[str, Any]:
        return {
            "ok": answered,
            "degraded": 0,
            "failures": {"overloaded": refused},
            "cpu_pct": {"server": cpu_pct},
        }

    result = {"window_s": 1.0, "reps": [rep(10, 0, 1.0), rep(1000, 2, 8.0)]}
    # (10 ms + (80 ms - 2 admitted x 5 ms)) / 1010 refusals
    assert _refusal_cpu_ms(result, admitted_ms=5.0) == pytest.approx(80.0 / 1010)
    assert math.isnan(_refusal_cpu_ms({"window_s": 1.0, "reps": [rep(0, 1, 1.0)]}, 5.0))
    assert math.isnan(_refusal_cpu_ms(None, 5.0))


def test_rounds_go_back_and_forth_so_no_configuration_always_follows_another() -> None:
    from bench.harness.rounds import interleaved

    built = interleaved(3, *(lambda n, share, name=name: (name, n, share) for name in "ABC"))
    assert [(name, n) for name, n, _ in built] == [
        ("A", 1),
        ("B", 1),
        ("C", 1),
        ("C", 2),
        ("B", 2),
        ("A", 2),
        ("A", 3),
        ("B", 3),
        ("C", 3),
    ]
    assert {share for _, _, share in built} == {1 / 3}


def test_the_brownout_ratio_is_taken_over_rounds_run_in_turn() -> None:
    """alone and mixed alternate (back and forth), a third of the repetitions each round;
    their rounds are joined for the goals, and each round's ratio is kept apart."""
    from bench.harness import brownout
    from bench.harness.rounds import merged, round_ratios
    from bench.harness.runner import Timing
    from bench.harness.scenario import Scale

    configs = brownout._configs(Scale(quick=False))
    assert [c.label for c in configs][:7] == [
        "alone-r1-cpu",
        "mixed-r1-cpu",
        "mixed-r2-cpu",
        "alone-r2-cpu",
        "alone-r3-cpu",
        "mixed-r3-cpu",
        "ignored-cpu",
    ]
    full = Timing(reps=30, window_s=0.5, warmup_s=2.5)
    assert [c.timing(full).reps for c in configs if c.label.startswith("alone-r")] == [10] * 6

    def result(per_s: list[float], refused: int) -> dict[str, Any]:
        windows = [{"whole": 0, "lighter": 0, "failures": {"overloaded": refused}}] * len(per_s)
        return {
            "reps": [{"p99_ms": 50.0, "failures": {}}] * len(per_s),
            "pooled": {"p99_ms": 60.0},
            "essential": {"per_s": per_s, "answers": [int(x) for x in per_s]},
            "companion": {"windows": windows, "refused": refused * len(per_s), "late": 0},
            "brownout_levels": [[9.5, 0.6]],
        }

    rounds = [result([100.0, 110.0], 5), result([90.0], 7)]
    joined = merged(rounds)
    assert joined["essential"]["per_s"] == [100.0, 110.0, 90.0]
    assert len(joined["reps"]) == 3 and joined["rounds_p99_ms"] == [60.0, 60.0]
    assert joined["companion"]["refused"] == 17 and len(joined["companion"]["windows"]) == 3
    assert joined["brownout_levels"] == [[9.5, 0.6], [9.5, 0.6]]
    assert "error" in merged([rounds[0], {"error": "stack failed"}])
    assert merged([rounds[0], None]) == {"error": "a round did not run"}
    ratios = round_ratios(
        [result([95.0], 0), result([80.0], 0)],
        [result([100.0], 0), result([100.0, 60.0], 0)],
        lambda r: (r or {})["essential"]["per_s"],
    )
    assert ratios == pytest.approx([0.95, 1.0])


def test_the_tracing_plot_has_a_series_per_round_with_every_mode() -> None:
    from bench.analysis.plot_series import TRACING_MODES, tracing_series

    modes = [mode for mode, _ in TRACING_MODES]
    rounds: dict[str, dict[str, Any]] = {
        f"tracing/tracing-{m}-r{n}/c20": {} for n in (1, 2, 10) for m in modes
    }
    series = tracing_series({"fair/polite-r1-cpu/c50": {}, **rounds})
    assert list(series) == ["round 1", "round 2", "round 10"]
    assert series["round 2"] == [f"tracing/tracing-{m}-r2/c20" for m in modes]
    plain = tracing_series({f"tracing/tracing-{m}/c20": {} for m in modes})
    assert plain == {"fanout": [f"tracing/tracing-{m}/c20" for m in modes]}
