"""Timing behaviour on a clock the test moves: the breaker, the retry budget, pacing, a
deadline cutting a task. Nothing here waits on the wall clock, so a busy machine changes
nothing (service/testing.py)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent.event import Event

from lookups.clock import SYSTEM_CLOCK
from lookups.deadline import Deadline
from lookups.errors import CircuitOpen
from lookups.resilience.breaker import BreakerPolicy, CircuitBreaker, CircuitState
from lookups.resilience.guard import RetryBudget
from service.engine.fanout import FanOut
from service.engine.settings import FanOutSettings
from service.engine.tasks import RequestContext, Task, TaskStatus
from service.overload.pacing import ConnectionPacing
from service.testing import FakeClock

ROOT = Path(__file__).resolve().parent.parent


def state(breaker: CircuitBreaker) -> CircuitState:
    """The breaker's state, read anew after each step that may move it."""
    return breaker.state


def _breaker(clock: FakeClock, open_ms: int = 2000) -> CircuitBreaker:
    return CircuitBreaker("db", BreakerPolicy(consecutive_failures=3, open_ms=open_ms), clock)


def _fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        breaker.record(failed=True, trial=breaker.check())


def test_an_outage_is_logged_when_it_begins_and_when_it_ends_not_at_every_probe(
    caplog: Any,
) -> None:
    """A dead backend makes the circuit half-open and open again every ``open_ms``: those
    probes are DEBUG lines; the operator gets one WARNING and one INFO for the outage."""
    clock = FakeClock()
    breaker = _breaker(clock)
    with caplog.at_level(logging.DEBUG, logger="lookups.resilience.breaker"):
        _fail(breaker, 3)
        for _ in range(10):  # ten failed probes, one every two seconds
            clock.advance(2.0)
            _fail(breaker, 1)
        clock.advance(2.0)
        breaker.record(failed=False, trial=breaker.check())
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert said == [
        ("WARNING", "circuit db: closed -> open for 2000 ms (failing fast)"),
        ("INFO", "circuit db: half_open -> closed after 22.0 s, 10 trial calls failed"),
    ]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 21  # the probing


def test_the_breaker_stays_open_for_exactly_open_ms_then_lets_one_trial_call_through() -> None:
    clock = FakeClock()
    breaker = _breaker(clock)
    _fail(breaker, 3)
    assert state(breaker) is CircuitState.OPEN
    clock.advance(1.999)
    with pytest.raises(CircuitOpen):
        breaker.check()
    clock.advance(0.001)
    assert breaker.check() is True  # the trial call
    assert state(breaker) is CircuitState.HALF_OPEN
    with pytest.raises(CircuitOpen):
        breaker.check()  # one trial call at a time
    breaker.record(failed=False, trial=True)
    assert state(breaker) is CircuitState.CLOSED
    assert breaker.check() is False


def test_a_failed_trial_call_opens_the_breaker_for_another_full_period() -> None:
    clock = FakeClock()
    breaker = _breaker(clock, open_ms=500)
    _fail(breaker, 3)
    clock.advance(0.5)
    breaker.record(failed=True, trial=breaker.check())
    assert (breaker.state, breaker.opened) == (CircuitState.OPEN, 2)
    clock.advance(0.499)
    with pytest.raises(CircuitOpen):
        breaker.check()
    clock.advance(0.001)
    assert breaker.check() is True


def test_the_failure_rate_counts_only_the_window() -> None:
    clock = FakeClock()
    policy = BreakerPolicy(consecutive_failures=100, failure_rate=0.5, window_s=10.0, min_calls=4)
    breaker = CircuitBreaker("db", policy, clock)
    for failed in (True, True, False):
        breaker.record(failed)
    clock.advance(10.5)  # those three leave the window
    for failed in (True, False, False, True):
        breaker.record(failed)
    assert state(breaker) is CircuitState.CLOSED  # 2 of 4 is not more than half
    breaker.record(True)
    assert state(breaker) is CircuitState.OPEN  # 3 of 5


def test_the_retry_budget_earns_min_per_s_tokens_a_second_and_no_more() -> None:
    clock = FakeClock()
    budget = RetryBudget(0.1, reserve=2.0, max_tokens=5.0, min_per_s=8.0, clock=clock)
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]
    clock.advance(0.0625)  # half a token (binary fractions: the sums are exact)
    assert budget.try_retry() is False
    clock.advance(0.0625)
    assert budget.try_retry() is True
    clock.advance(60.0)  # the balance stops at max_tokens
    assert sum(budget.try_retry() for _ in range(10)) == 5


def test_a_caller_refused_is_early_until_the_pause_it_was_told_ends() -> None:
    clock = FakeClock()
    pacing = ConnectionPacing(clock)
    pacing.arrived(Deadline.after_ms(1000, clock))
    assert pacing.refused(200, Deadline.after_ms(1000, clock)) == 0.0  # on time: no hold
    assert pacing.back_early()
    told_s = pacing.early_for_s()
    assert 0 < told_s <= 0.2
    clock.advance(told_s / 2)
    assert pacing.early_for_s() == pytest.approx(told_s / 2)
    pacing.arrived(Deadline.after_ms(1000, clock))
    held_s = pacing.refused(200, Deadline.after_ms(1000, clock))  # came back early: held
    assert 0 < held_s <= 0.2
    assert pacing.take_hold() == held_s and pacing.take_hold() == 0.0
    clock.advance(pacing.early_for_s())
    assert not pacing.back_early()


def test_the_request_deadline_cuts_a_task_when_the_clock_passes_it() -> None:
    clock = FakeClock()
    fan = FanOut(FanOutSettings(abandon_grace_ms=100), clock)
    started, never = Event(), Event()

    def stuck(deadline: Deadline) -> Any:
        started.set()
        never.wait()

    def quick(deadline: Deadline) -> str:
        return "ok"

    tasks = [
        Task(name="stuck", source="test", call=stuck, timeout_ms=60_000),
        Task(name="quick", source="test", call=quick, timeout_ms=60_000),
    ]
    request = RequestContext.start("test", 30_000, clock=clock)
    running = gevent.spawn(fan.run, tasks, request)
    started.wait(5)
    clock.advance(29.9)
    assert not running.ready()  # the deadline has not passed: the call still waits
    clock.advance(0.1)
    result = running.get(timeout=5)
    outcomes = {o.name: o for o in result.outcomes}
    assert outcomes["quick"].status is TaskStatus.OK
    assert outcomes["stuck"].status is TaskStatus.TIMEOUT
    assert outcomes["stuck"].elapsed_ms == pytest.approx(30_000.0)
    never.set()
    assert fan.wait_reapers(timeout_s=5)


def test_the_system_clock_reads_the_machine() -> None:
    first = SYSTEM_CLOCK.monotonic()
    assert SYSTEM_CLOCK.monotonic() >= first
    assert SYSTEM_CLOCK.wall() > 1.6e9  # after 2020
    set_event = Event()
    set_event.set()
    assert SYSTEM_CLOCK.wait(set_event, first + 60) is True
    assert SYSTEM_CLOCK.wait(Event(), SYSTEM_CLOCK.monotonic()) is False


def test_a_sleep_on_the_fake_clock_ends_when_the_clock_passes_it_not_on_wall_time() -> None:
    clock = FakeClock()
    woke: list[float] = []

    def sleeper() -> None:
        clock.sleep(30.0)
        woke.append(clock.monotonic())

    sleeping = gevent.spawn(sleeper)
    gevent.sleep(0.05)  # wall time passes; the clock's does not
    clock.advance(29.0)
    assert not woke
    clock.advance(1.0)
    sleeping.join(timeout=5)
    assert woke == [1030.0]


def test_the_system_clock_sleeps_the_machine_time() -> None:
    started = SYSTEM_CLOCK.monotonic()
    SYSTEM_CLOCK.sleep(0.02)
    assert SYSTEM_CLOCK.monotonic() - started >= 0.02


#: What reads the time; only lookups/clock.py may (the samples, test fixtures that ship
#: for the demo, aside).
_TIME_READS = {"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"}


def _time_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"from time import {a.name}" for a in node.names if a.name in _TIME_READS]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "time" and node.attr in _TIME_READS:
                found.append(f"time.{node.attr}")
            elif node.value.id == "loop" and node.attr == "now":
                found.append("loop.now")
    return [f"{path.relative_to(ROOT)}: {what}" for what in found]


def test_product_code_reads_the_time_in_the_clock_module_only() -> None:
    reads = [
        read
        for package in ("service", "lookups", "tracing")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "samples" not in path.parts
        for read in _time_reads(path)
    ]
    assert reads and all(read.startswith("lookups/clock.py") for read in reads), reads


def _clock_parameters(path: Path) -> list[str]:
    """Each parameter named ``clock`` in ``path``, with its annotation as written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
                if arg.arg == "clock":
                    shape = ast.unparse(arg.annotation) if arg.annotation else "(none)"
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {shape}")
    return found


def test_every_part_takes_the_clock_in_one_shape() -> None:
    """A ``Clock``, never a bare callable: a part reads ``monotonic()`` or ``wall()`` of
    the service's clock, and a test gives every part the same ``FakeClock``."""
    parameters = [
        parameter
        for package in ("service", "lookups", "tracing")
        for path in sorted((ROOT / package).rglob("*.py"))
        for parameter in _clock_parameters(path)
    ]
    assert len(parameters) > 20
    assert [p for p in parameters if not p.endswith(": Clock")] == []
