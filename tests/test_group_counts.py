"""A worker group's counts outlive its workers: reloads and restarts are no counter reset, and
every call answered is counted. The ledger on expositions, then a real two-worker
``fanout serve`` under callers through three reloads."""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import gevent
import requests
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from thriftpy2.transport import TTransportException

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from service.workers.counts import GroupCounts
from service.workers.kept_calls import CALLS
from tests.support.group import (  # noqa: F401 (a fixture)
    all_serving,
    group_env,
    group_ports,
    reload_and_wait,
    scrape,
)
from tests.support.sockets import wait_for
from tests.support.workers import Server, serve  # noqa: F401 (a fixture)
from tracing.call_tally import CallTally, read_call_tally
from tracing.metrics import SECONDS_BUCKETS


def _exposition(calls: float, in_flight: float, fast: float = 0.0) -> str:
    """A worker's exposition: a counter, a gauge and a histogram."""
    return f"""# HELP calls Calls answered
# TYPE calls_total counter
calls_total{{method="get"}} {calls}
# HELP in_flight Calls in flight
# TYPE in_flight gauge
in_flight {in_flight}
# HELP took Call durations
# TYPE took histogram
took_bucket{{le="0.1"}} {fast}
took_bucket{{le="+Inf"}} {calls}
took_count {calls}
took_sum {calls / 10}
"""


def _sample(ledger: GroupCounts, name: str, position: str = "0", **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` for worker ``position`` in the ledger's
    exposition (it must parse)."""

    wanted = {**labels, "worker": position}
    text = ledger.exposition()
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels == wanted
    ]
    assert len(values) == 1, (name, wanted, text)
    return float(values[0])


def test_a_retired_workers_final_counts_and_its_successors_add_up() -> None:
    ledger = GroupCounts()
    ledger.scraped(1, "0", _exposition(calls=10, in_flight=3, fast=4))
    ledger.scraped(2, "0", _exposition(calls=1, in_flight=1, fast=1))  # the new generation
    assert _sample(ledger, "calls_total", method="get") == 11.0  # both running, summed
    assert _sample(ledger, "took_count") == 11.0
    ledger.final(1, "0", _exposition(calls=14, in_flight=0, fast=6))  # it drained 4 more
    ledger.exited(1, "0")
    ledger.scraped(2, "0", _exposition(calls=5, in_flight=2, fast=2))
    assert _sample(ledger, "took_count") == 19.0
    assert _sample(ledger, "took_bucket", le="0.1") == 8.0
    assert _sample(ledger, "took_sum") == 1.9
    assert _sample(ledger, "in_flight") == 2.0  # a gauge: the newest worker's, not a sum


def test_a_killed_worker_counts_at_its_last_scrape_and_a_late_answer_is_not_counted() -> None:
    ledger = GroupCounts()
    ledger.scraped(1, "1", _exposition(calls=7, in_flight=2))
    ledger.exited(1, "1")  # killed: no last counts
    ledger.scraped(1, "1", _exposition(calls=9, in_flight=0))  # a fetch that was under way
    assert _sample(ledger, "took_count", "1") == 7.0
    ledger.scraped(3, "1", _exposition(calls=2, in_flight=1))
    assert _sample(ledger, "took_count", "1") == 9.0
    assert _sample(ledger, "in_flight", "1") == 1.0


def test_a_position_whose_worker_is_gone_keeps_its_counts_and_its_last_gauges() -> None:
    ledger = GroupCounts()
    ledger.scraped(1, "0", _exposition(calls=3, in_flight=1))
    ledger.scraped(2, "1", _exposition(calls=4, in_flight=2))
    ledger.final(2, "1", _exposition(calls=6, in_flight=0))
    ledger.exited(2, "1")  # retired (one worker fewer): position 1 has no worker now
    assert ledger.positions() == {"0", "1"}
    assert _sample(ledger, "took_count", "1") == 6.0
    assert _sample(ledger, "in_flight", "1") == 2.0  # its last answer, given again
    assert _sample(ledger, "took_count", "0") == 3.0


def _calls_exposition(calls: int) -> str:
    """A worker's exposition of ``calls`` answered within 10 ms, as the exporter writes it."""
    labels = 'otel_scope_name="fanout.server",rpc_method="AppStats/get_app_stats"'
    lines = [f"# TYPE {CALLS} histogram"]
    for bound in (*SECONDS_BUCKETS, math.inf):
        counted = calls if bound >= 0.01 else 0
        lines.append(f'{CALLS}_bucket{{le="{floatToGoString(bound)}",{labels}}} {counted}')
    lines += [f"{CALLS}_count{{{labels}}} {calls}", f"{CALLS}_sum{{{labels}}} {calls * 0.01}"]
    return "\n".join(lines) + "\n"


def test_a_killed_workers_calls_count_as_it_kept_them_past_its_last_scrape(
    tmp_path: Path,
) -> None:
    ledger = GroupCounts()
    ledger.scraped(1, "0", _calls_exposition(3))
    ledger.scraped(2, "1", _calls_exposition(4))
    tally = CallTally(tmp_path / "worker-1")
    for _ in range(5):  # its 3 scraped, and 2 answered before it was killed
        tally.add("AppStats/get_app_stats", "", 0.01)
    ledger.exited(1, "0", read_call_tally(tmp_path / "worker-1"))
    assert _answered_calls(ledger.exposition()) == {"0": 5.0, "1": 4.0}
    # One killed before the master ever scraped it: its calls are written as the others'.
    never = CallTally(tmp_path / "worker-3")
    never.add("AppStats/get_app_stats", "", 0.01)
    ledger.exited(3, "0", read_call_tally(tmp_path / "worker-3"))
    assert _answered_calls(ledger.exposition()) == {"0": 6.0, "1": 4.0}
    assert _sample(ledger, f"{CALLS}_bucket", "0", le="0.01", **_SCOPE) == 6.0


_SCOPE = {"otel_scope_name": "fanout.server", "rpc_method": "AppStats/get_app_stats"}


def _answered_calls(scraped: str) -> dict[str, float]:
    """Each worker position's count of get_app_stats calls answered."""
    return {
        worker: float(value)
        for worker, value in re.findall(
            r'^rpc_server_call_duration_seconds_count\{.*rpc_method="AppStats/get_app_stats".*'
            r'worker="(\d+)".*\} (\S+)$',
            scraped,
            re.M,
        )
    }


def test_reloads_under_calls_fail_none_and_every_call_answered_is_counted_and_never_goes_back(
    serve: Callable[..., Server], group_ports: dict[str, int]
) -> None:
    server = serve("--workers", "2", env=group_env(group_ports))
    wait_for(lambda: all_serving(group_ports, 2), 60, "both workers serving")
    answered = [0]
    calling = [True]

    def caller() -> None:
        # Budgets a stressed run keeps: counting is what is tested, and a reload there once
        # left a call unanswered for over 5 s.
        with AppStatsClient(*server.address, timeout_ms=30_000) as client:
            while calling[0]:  # a call under way is finished and counted, never cut
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=20_000)
                answered[0] += 1
                gevent.sleep(0.01)

    seen: list[dict[str, float]] = []

    def watch() -> None:
        while True:
            try:
                seen.append(_answered_calls(scrape(group_ports)))
            except requests.RequestException:
                pass  # a scrape a loaded machine answered late: the next one counts
            gevent.sleep(0.2)

    callers = [gevent.spawn(caller) for _ in range(4)]
    watcher = gevent.spawn(watch)
    try:
        for _ in range(2):  # the second reloads workers that a reload started
            reload_and_wait(server, group_ports)
            gevent.sleep(0.5)
        calling[0] = False
        gevent.joinall(callers, timeout=30, raise_error=True)
        # The old generation has gone: its final counts stand in for it.
        wait_for(
            lambda: sum(_answered_calls(scrape(group_ports)).values()) == answered[0],
            10,
            "the scrape counting every call answered",
        )
    finally:
        calling[0] = False
        watcher.kill()
    assert all(not caller.exception for caller in callers), [c.exception for c in callers]
    assert answered[0] > 20 and len(seen) > 10
    for before, after in itertools.pairwise(seen):  # no counter reset, ever
        assert all(after.get(worker, 0.0) >= count for worker, count in before.items()), (
            before,
            after,
        )
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    logged = server.logged()  # each new generation took the ports the old one gave up
    assert "Traceback" not in logged and "Address already in use" not in logged, logged[-3000:]


def test_every_call_answered_is_counted_when_the_workers_are_killed_without_a_word(
    serve: Callable[..., Server], group_ports: dict[str, int]
) -> None:
    server = serve("--workers", "2", env=group_env(group_ports))
    wait_for(lambda: all_serving(group_ports, 2), 60, "both workers serving")
    answered, cut = [0], [0]
    calling = [True]

    def caller() -> None:
        with AppStatsClient(*server.address, timeout_ms=30_000) as client:
            while calling[0]:
                try:
                    client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=20_000)
                    answered[0] += 1
                except TTransportException:  # its worker killed under it, and the retry too
                    cut[0] += 1
                gevent.sleep(0.01)

    callers = [gevent.spawn(caller) for _ in range(4)]
    try:
        wait_for(lambda: answered[0] >= 20, 60, "calls answered")
        scrape(group_ports)  # the master's last scrape of the workers it kills
        scraped_at = answered[0]
        wait_for(lambda: answered[0] >= scraped_at + 40, 60, "calls answered since the scrape")
        victims = server.workers()
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: not set(victims) & set(server.workers()) and all_serving(group_ports, 2),
            60,
            "both workers replaced",
        )
        done = answered[0]
        wait_for(lambda: answered[0] >= done + 10, 60, "calls answered by the new workers")
    finally:
        calling[0] = False
        gevent.joinall(callers, timeout=30, raise_error=True)
    # A call in flight at the kill may be counted and then answered again by the client's
    # retry, or answered and not counted: one a caller at most.
    counted = sum(_answered_calls(scrape(group_ports)).values())
    assert abs(counted - answered[0]) <= len(callers), (counted, answered[0], cut[0])
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
