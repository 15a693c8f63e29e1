"""Timing behaviour on a clock the test moves: the breaker, the retry budget, pacing, a
deadline cutting a task. Nothing here waits on the wall clock, so a busy machine changes
nothing (service/testing.py)."""

from __future__ import annotations

import ast
import collections
import logging
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent.event import Event

from lookups.clock import SYSTEM_CLOCK, SystemClock
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


def test_a_join_on_the_fake_clock_ends_when_the_task_does_or_the_clock_passes_until() -> None:
    clock = FakeClock()
    never, joined = Event(), list[bool]()
    stuck = gevent.spawn(never.wait)
    waiting = gevent.spawn(lambda: joined.append(clock.join(stuck, clock.monotonic() + 10.0)))
    gevent.sleep(0.05)  # wall time passes; the clock's does not
    clock.advance(9.9)
    assert not joined
    clock.advance(0.1)
    waiting.join(timeout=5)
    assert joined == [False]
    never.set()
    stuck.join(timeout=5)
    assert clock.join(stuck, clock.monotonic()) is True  # finished: True at once


def test_the_system_clock_joins_on_the_machine_time() -> None:
    done = gevent.spawn(lambda: None)
    done.join()
    assert SYSTEM_CLOCK.join(done, SYSTEM_CLOCK.monotonic()) is True
    never = Event()
    stuck = gevent.spawn(never.wait)
    started = SYSTEM_CLOCK.monotonic()
    assert SYSTEM_CLOCK.join(stuck, started + 0.02) is False
    assert SYSTEM_CLOCK.monotonic() - started >= 0.02
    stuck.kill()


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


def _in_product(find: Callable[[Path], list[str]], samples: bool = False) -> list[str]:
    """What ``find`` finds in each module of ``service``, ``lookups`` and ``tracing``; the
    samples (test fixtures that ship for the demo) only with ``samples``."""
    return [
        found
        for package in ("service", "lookups", "tracing")
        for path in sorted((ROOT / package).rglob("*.py"))
        if samples or "samples" not in path.parts
        for found in find(path)
    ]


def test_product_code_reads_the_time_in_the_clock_module_only() -> None:
    reads = _in_product(_time_reads)
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
    parameters = _in_product(_clock_parameters, samples=True)
    assert len(parameters) > 20
    assert [p for p in parameters if not p.endswith(": Clock")] == []


#: Where the machine's clock is read directly, and why: the clock module and the test
#: clocks built on it; the command line, which puts its own process together; the wire's
#: frame timeout and the hub monitor, which compare with what counts real time (the
#: socket's timeouts, gevent's switch tracer). Every other part reads the service's clock.
_MACHINE_CLOCK_READERS = {
    "lookups/clock.py",
    "service/testing.py",
    "service/cli/call.py",
    "service/cli/trace_ui.py",
    "service/wire/channel.py",
    "service/operations/hub_monitor.py",
}


def _machine_clock_reads(path: Path) -> list[str]:
    """Each ``SYSTEM_CLOCK.<reading or wait>`` in ``path`` (a default argument is a name,
    not a read: the caller that builds the part chooses its clock)."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} SYSTEM_CLOCK.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "SYSTEM_CLOCK"
    ]


def test_only_the_places_that_put_a_process_together_read_the_machine_clock() -> None:
    reads = _in_product(_machine_clock_reads)
    assert reads
    outside = [r for r in reads if r.split(":")[0] not in _MACHINE_CLOCK_READERS]
    assert outside == [], outside


_WAITS = {"sleep", "wait", "join", "joinall", "get", "acquire", "kill", "killall"}

#: Timed waits that do not go through the service's clock, and why each counts real time.
_REAL_TIME_WAITS = {
    # The clock itself, and the test clocks built on it.
    "lookups/clock.py",
    "service/testing.py",
    # The command line puts its own process together.
    "service/cli/trace_ui.py",
    # A held reply is written on the event loop's tick, as the holds are grouped by it.
    "service/listener/connection.py: gevent.sleep(on_the_tick(gevent.get_hub().loop, hold_s))",
    # A stop (the lame duck, then the drain) ends within the grace its supervisor counts in
    # real time (Kubernetes' terminationGracePeriodSeconds).
    "service/workers/lifecycle.py: gevent.sleep(settings.server.lame_duck_ms / 1000.0)",
    "service/listener/server.py: self._stopped.wait(timeout_s)",
    "service/listener/server.py: handlers.join(timeout=timeout_s)",
    # The event loop's delivery of a kill, not a policy of the service.
    "service/engine/fanout.py: run.ended.wait(timeout=_KILL_WAIT_S)",
    "service/listener/server.py: handlers.kill(block=True, timeout=1.0)",
    "service/client/hedging.py: gevent.killall(pending, block=True, timeout=1.0)",
    # A call's own semaphores, made per call: the timeout is the deadline's, on its clock.
    "service/engine/fanout.py: pool.acquire(timeout=until.remaining_s())",
    "service/engine/fanout.py: self._inflight.acquire(timeout=until.remaining_s())",
    # Slots that wait on the service's clock (OrderedSlots), given the deadline's time left.
    "service/client/connections.py: self._slots.acquire(timeout=deadline.remaining_s())",
    "lookups/backends/http.py: self.slots.acquire(timeout=left_s, flow=deadline.flow)",
    "lookups/backends/mongo.py: slots.acquire(timeout=left_s, flow=deadline.flow)",
    # At shutdown, for what is still running.
    "service/engine/fanout.py: gevent.joinall(list(self._reapers), timeout=timeout_s)",
    # Threads of their own (the native endpoints answer while the loop is blocked).
    "service/operations/native_http.py: self._ended.acquire(timeout=timeout_s + 1.0)",
    "service/operations/native_http.py: done.acquire(timeout=timeout_s)",
    # The supervisor: other processes' exits and signals, and their endpoints over HTTP.
    "service/workers/master.py: self._events.get(timeout=self._positions.next_wake_in())",
    "service/workers/stopping.py: events.get(timeout=remaining)",
    "service/workers/launch.py: reader.join(timeout=_LAST_WORDS_S)",
    "service/workers/group.py: gevent.joinall(fetches, timeout=WORKER_SCRAPE_TIMEOUT_S)",
    # Exporters send over the network at shutdown: the flush budget is real time.
    "tracing/setup.py: close.join(timeout=0.05)",
}


def _timed_waits(path: Path) -> list[str]:
    """Each call in ``path`` that waits for a duration it is given: ``sleep(x)`` (x not 0),
    or a wait, join, get, acquire or kill with a ``timeout``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        if node.func.attr not in _WAITS or re.search("clock|deadline", ast.unparse(receiver)):
            continue  # the clock's own waits, and a deadline's (on its clock)
        timed = any(keyword.arg == "timeout" for keyword in node.keywords)
        module_wait = isinstance(receiver, ast.Name) and receiver.id == "gevent"  # (objects, ...)
        if node.func.attr in ("wait", "join") and len(node.args) == 1 and not module_wait:
            timed = not isinstance(receiver, ast.Constant) and not isinstance(  # a timeout
                node.args[0], ast.Constant | ast.JoinedStr | ast.GeneratorExp | ast.ListComp
            )
        if node.func.attr == "sleep" and node.args:
            timed = not (isinstance(node.args[0], ast.Constant) and node.args[0].value == 0)
        if timed:
            found.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
    return found


def test_every_timed_wait_goes_through_the_clock_or_says_why_it_counts_real_time() -> None:
    waits = _in_product(_timed_waits)
    assert waits
    listed = {w for w in _REAL_TIME_WAITS if ": " in w}
    assert listed <= set(waits), listed - set(waits)  # the list names only waits still there
    unexplained = [
        w for w in waits if w not in _REAL_TIME_WAITS and w.split(":")[0] not in _REAL_TIME_WAITS
    ]
    assert unexplained == [], unexplained


def _clocks_in(root: Any) -> tuple[list[str], int]:
    """Every part reachable from ``root`` (objects of Fanout's own packages, their
    attributes, slots, containers and closures) that holds the machine's clock, by the
    path to it; and how many hold another clock."""
    seen, queue = {id(root)}, collections.deque([(root, "service")])
    machine, other = [], 0
    while queue:
        obj, path = queue.popleft()
        for value, where in _parts_of(obj, path):
            if isinstance(value, SystemClock):
                machine.append(where)
            elif isinstance(value, FakeClock):
                other += 1
            elif not isinstance(value, str | bytes | int | float | type | None) and (
                id(value) not in seen
            ):
                seen.add(id(value))
                queue.append((value, where))
    return machine, other


def _parts_of(obj: Any, path: str) -> list[tuple[Any, str]]:
    if isinstance(obj, dict):
        return [(value, f"{path}[{key!r}]") for key, value in list(obj.items())]
    if isinstance(obj, list | tuple | set | frozenset | collections.deque):
        return [(value, f"{path}[{i}]") for i, value in enumerate(list(obj))]
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        return [(cell.cell_contents, f"{path}.<closure>") for cell in cells if _filled(cell)]
    if not (type(obj).__module__ or "").startswith(("service.", "lookups.", "tracing.")):
        return []
    attributes = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attributes[name] = getattr(obj, name)
    return [(value, f"{path}.{name}") for name, value in attributes.items()]


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # an empty cell raises ValueError
    except ValueError:
        return False
    return True


def test_every_part_of_a_service_reads_the_clock_it_was_given() -> None:
    """A part built with the default clock would run on the machine's time inside a
    service given a FakeClock: its breaker, cache outage or pacing would not move with
    the test's clock. Every part reachable from the service holds the service's clock,
    with the cache on Redis, coalescing and admission on; the hub monitor alone reads
    the machine's (see _MACHINE_CLOCK_READERS)."""
    from service.app import FanOutService
    from service.settings.config import load_settings

    settings = load_settings(
        env={},
        overrides={
            "server.port": 0,
            "server.probe_port": -1,
            "cache.enabled": True,
            "cache.url": "redis://127.0.0.1:1",  # a client is made, never connected here
        },
    )
    service = FanOutService(settings, clock=FakeClock())
    try:
        machine, given = _clocks_in(service)
    finally:
        service.close()
    assert given > 20  # the walk reaches the parts
    assert [path for path in machine if not path.startswith("service.hub_monitor")] == []
