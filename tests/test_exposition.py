"""The master's reading and writing of the workers' expositions, held against
prometheus_client's own parser: what it reads of the merged text is what it reads of
each worker's, with a ``worker`` label."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.workers.exposition import Exposition, parse_exposition, render_expositions

WORKER = """# HELP target_info Target metadata
# TYPE target_info gauge
target_info{service_name="fanout"} 1.0
# HELP calls_total Calls answered, "quoted" and \\\\ escaped\\nover lines
# TYPE calls_total counter
calls_total{method="get",note="a \\"quoted\\" \\\\ value\\nwith a newline"} 42.0
calls_total{method="put",note=""} 0.0
calls_created{method="get"} 1.7e9
# HELP in_flight Calls in flight
# TYPE in_flight gauge
in_flight 3.0
# HELP ratio Not a number yet
# TYPE ratio gauge
ratio NaN
# HELP took Call durations
# TYPE took histogram
took_bucket{le="0.1"} 4.0
took_bucket{le="+Inf"} 42.0
took_count 42.0
took_sum 4.25
"""


def _official(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """By name and labels, as Prometheus stores them: a label with an empty value is none."""
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if v))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_every_worker_sample_reads_back_the_same_with_its_worker_label() -> None:
    parsed = parse_exposition(WORKER)
    merged = _official(render_expositions({"0": parsed, "1": parsed}, "worker"))
    alone = _official(WORKER)
    assert len(merged) == 2 * len(alone)
    for (name, labels), value in alone.items():
        for worker in ("0", "1"):
            key = (name, tuple(sorted((*labels, ("worker", worker)))))
            assert _same(merged[key], value), (key, merged.get(key), value)


def test_the_headers_and_types_are_kept_and_created_samples_dropped() -> None:
    text = render_expositions({"0": parse_exposition(WORKER)}, "worker")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["calls"].type == "counter" and "escaped" in families["calls"].documentation
    assert families["took"].type == "histogram" and families["in_flight"].type == "gauge"
    assert "_created" not in text


def test_counts_add_up_and_gauges_are_left_to_the_newest() -> None:
    first, second = parse_exposition(WORKER), parse_exposition(WORKER.replace("42.0", "8.0"))
    total = Exposition()
    total.add(first, cumulative=True)
    total.add(second, cumulative=True)
    assert total.samples["took"]["took_count"] == 50.0
    assert "in_flight" not in total.samples  # a gauge is not summed
    gauges = Exposition()
    gauges.add(second, cumulative=False)
    assert gauges.samples["in_flight"]["in_flight"] == 3.0 and "took" not in gauges.samples


def test_a_sample_line_that_is_not_a_sample_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_exposition("# TYPE up gauge\nup not-a-number\n")
    with pytest.raises(ValueError):
        parse_exposition("# TYPE up gauge\nup\n")


def test_one_series_under_two_keys_is_one_series_in_the_merged_scrape() -> None:
    # The exporter writes error_type="" only once another series of the family has one:
    # a worker that has refused a call, and its predecessor in the position that had not.
    before = parse_exposition('# TYPE calls counter\ncalls_total{method="get"} 5.0\n')
    after = parse_exposition(
        '# TYPE calls counter\ncalls_total{error_type="",method="get"} 2.0\n'
        'calls_total{error_type="Overloaded",method="get"} 1.0\n'
        'calls_total{a="",b=""} 1.0\ncalls_total{method="put",note=""} 1.0\n'
    )
    total = Exposition()
    total.add(before, cumulative=True)
    total.add(after, cumulative=True)
    assert total.samples["calls"] == {
        'calls_total{method="get"}': 7.0,
        'calls_total{error_type="Overloaded",method="get"}': 1.0,
        "calls_total": 1.0,
        'calls_total{method="put"}': 1.0,
    }
