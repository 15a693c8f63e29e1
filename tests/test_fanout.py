"""The fan-out engine: parallelism, bounds, deadlines, cancellation, outcomes."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import Any

import gevent
import gevent.event
import pytest
from opentelemetry import trace

from lookups.deadline import Deadline
from lookups.errors import BackendUnavailable, BadBackendResponse
from service.engine.fanout import FanOut
from service.engine.settings import AdmissionSettings, FanOutSettings
from service.engine.tasks import (
    FanOutOverloaded,
    RequestContext,
    RequiredTaskFailed,
    Task,
    TaskStatus,
)
from service.overload.gate import CallGate
from service.testing import FakeClock
from tracing.context import TaskRunners

# A context variable the caller sets: the engine must carry it into every task.
caller_value: contextvars.ContextVar[str] = contextvars.ContextVar("caller_value", default="unset")


def sleeper(seconds: float, value: Any = "done") -> Callable[[Deadline], Any]:
    def call(deadline: Deadline) -> Any:
        left_s = deadline.remaining_s()
        gevent.sleep(min(seconds, left_s))
        if seconds > left_s:
            raise TimeoutError(f"needed {seconds}s, had {left_s:.3f}s")
        return value

    return call


def stubborn(seconds: float) -> Callable[[Deadline], Any]:
    """A task that ignores its deadline, like a library call with no timeout."""

    def call(deadline: Deadline) -> Any:
        gevent.sleep(seconds)
        return "late"

    return call


def raiser(exc: Exception, after_s: float = 0.0) -> Callable[[Deadline], Any]:
    def call(deadline: Deadline) -> Any:
        gevent.sleep(after_s)
        raise exc

    return call


def task(
    name: str, call: Callable[[Deadline], Any], timeout_ms: int = 2000, required: bool = False
) -> Task:
    return Task(name=name, source="test", call=call, timeout_ms=timeout_ms, required=required)


def within(deadline_ms: float) -> RequestContext:
    """A request due ``deadline_ms`` from now."""
    return RequestContext.start("test", deadline_ms)


def engine(**overrides: Any) -> FanOut:
    return FanOut(FanOutSettings(**{"abandon_grace_ms": 100, **overrides}))


def test_tasks_run_in_parallel_not_in_sequence() -> None:
    fan = engine()
    running = {"now": 0, "most": 0}

    def overlapping(value: int) -> Callable[[Deadline], Any]:
        def call(deadline: Deadline) -> Any:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
            try:
                return sleeper(0.1, value)(deadline)
            finally:
                running["now"] -= 1

        return call

    result = fan.run([task(f"t{i}", overlapping(i)) for i in range(7)], within(3000))
    assert [o.status for o in result.outcomes] == [TaskStatus.OK] * 7
    assert {o.name: o.value for o in result.outcomes} == {f"t{i}": i for i in range(7)}
    assert running["most"] == 7  # all seven at once (told by the tasks, not by a clock)


def test_request_pool_bounds_concurrency() -> None:
    fan = engine(pool_size=2, queue_timeout_ms=2000)
    running, peak = [0], [0]

    def tracked(deadline: Deadline) -> str:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        gevent.sleep(0.03)
        running[0] -= 1
        return "ok"

    result = fan.run([task(f"t{i}", tracked) for i in range(6)], within(3000))
    assert all(o.ok for o in result.outcomes)
    assert peak[0] == 2
    assert fan.inflight == 0


def test_task_waiting_past_queue_timeout_is_rejected() -> None:
    fan = engine(pool_size=1, queue_timeout_ms=30)
    result = fan.run([task("first", sleeper(0.2)), task("second", sleeper(0.01))], within(3000))
    first, second = result.outcomes
    assert first.status is TaskStatus.OK
    assert second.status is TaskStatus.REJECTED and second.retryable
    assert second.pool_wait_ms >= 25
    assert fan.stats.rejected == 1


def test_no_task_can_start_raises_overloaded() -> None:
    fan = engine(max_inflight_tasks=1, queue_timeout_ms=30)
    hog = gevent.spawn(fan.run, [task("hog", sleeper(0.3))], within(3000))
    gevent.sleep(0.01)
    assert fan.inflight == 1
    gate = CallGate(AdmissionSettings(), 3000)
    context = within(3000)
    with pytest.raises(FanOutOverloaded) as caught, gate.admitted(context.deadline):
        fan.run([task("a", sleeper(0.01)), task("b", sleeper(0.01))], context)
    assert caught.value.retry_after_ms > 0  # the engine's refusal, told when by the gate
    assert hog.get(timeout=2).outcomes[0].ok
    assert fan.inflight == 0
    # The refused call counts once, as overloaded; its tasks reached no caller.
    assert (gate.stats.overloaded, fan.stats.rejected) == (1, 0)


def test_children_see_the_callers_context_variables_and_parent_span(spans: Any) -> None:
    fan = engine()
    seen: dict[str, Any] = {}

    def look(deadline: Deadline) -> str:
        seen["value"] = caller_value.get()
        seen["parent"] = trace.get_current_span().get_span_context()
        return "ok"

    tracer = trace.get_tracer("test")
    token = caller_value.set("req-1")
    try:
        with tracer.start_as_current_span("request") as root:
            fan.run([task("look", look)], within(1000))
    finally:
        caller_value.reset(token)
    assert seen["value"] == "req-1"
    (task_span,) = [s for s in spans.get_finished_spans() if s.name == "fanout.task look"]
    assert task_span.parent.span_id == root.get_span_context().span_id
    # Inside the task, the current span is the task's own span, a child of the request's.
    assert seen["parent"].span_id == task_span.context.span_id


def test_a_task_cut_by_the_deadline_has_its_span_ended_as_an_error_then(spans: Any) -> None:
    fan = engine(abandon_grace_ms=400)
    with trace.get_tracer("test").start_as_current_span("request") as root:
        result = fan.run([task("quick", sleeper(0.01)), task("slow", stubborn(0.3))], within(100))
        answered = time.time_ns()
    assert [o.status for o in result.outcomes] == [TaskStatus.OK, TaskStatus.TIMEOUT]
    (cut,) = [s for s in spans.get_finished_spans() if s.name == "fanout.task slow"]
    assert cut.end_time <= answered  # ended when the request stopped waiting, not later
    assert cut.status.status_code is trace.StatusCode.ERROR
    assert cut.status.description == "request deadline passed"
    assert cut.attributes["fanout.task.status"] == "TIMEOUT"
    assert [e.attributes["reason"] for e in cut.events if e.name == "fanout.task.cut"] == [
        "request deadline passed"
    ]
    (quick,) = [s for s in spans.get_finished_spans() if s.name == "fanout.task quick"]
    assert (
        quick.status.status_code is trace.StatusCode.UNSET
        and quick.parent.span_id == root.get_span_context().span_id
    )
    assert fan.wait_reapers(2.0)
    # The straggler finishing later changes nothing the trace already shows.
    assert len([s for s in spans.get_finished_spans() if s.name == "fanout.task slow"]) == 1
    assert cut.attributes["fanout.task.status"] == "TIMEOUT"


def test_tasks_cancelled_by_a_failed_required_task_end_with_it(spans: Any) -> None:
    fan = engine()
    with pytest.raises(RequiredTaskFailed):
        fan.run(
            [
                task("must", raiser(BackendUnavailable("down"), 0.01), required=True),
                task("other", stubborn(0.3)),
            ],
            within(2000),
        )
    answered = time.time_ns()
    (other,) = [s for s in spans.get_finished_spans() if s.name == "fanout.task other"]
    assert other.end_time <= answered and other.attributes["fanout.task.status"] == "CANCELLED"
    assert [e.attributes["reason"] for e in other.events if e.name == "fanout.task.cut"] == [
        "required task 'must' failed"
    ]
    assert fan.wait_reapers(2.0)


def test_deadline_cuts_stragglers_and_reaper_frees_their_slots() -> None:
    fan = engine(abandon_grace_ms=50)
    began = time.monotonic()
    result = fan.run([task("fast", sleeper(0.01)), task("stuck", stubborn(30))], within(150))
    assert time.monotonic() - began < 5  # the straggler would take 30 s
    fast, stuck = result.outcomes
    assert fast.status is TaskStatus.OK
    assert stuck.status is TaskStatus.TIMEOUT and stuck.retryable
    assert fan.stats.abandoned == 1
    assert fan.inflight == 1  # the straggler still holds its slot during the grace
    assert fan.wait_reapers(timeout_s=3)
    assert fan.stats.killed == 1
    assert fan.inflight == 0


def test_the_abandon_grace_passes_on_the_calls_clock() -> None:
    """A straggler is killed once the service's clock has moved the grace on, however
    little wall time passed: here a minute of grace, moved by hand."""
    clock = FakeClock()
    fan = engine(abandon_grace_ms=60_000)
    runner = gevent.spawn(
        fan.run, [task("stuck", stubborn(30))], RequestContext.start("test", 150, clock=clock)
    )
    gevent.sleep(0.01)  # the task runs; the call waits for its deadline on the clock
    clock.advance(0.2)
    (stuck,) = runner.get(timeout=5).outcomes
    assert stuck.status is TaskStatus.TIMEOUT and fan.stats.abandoned == 1
    gevent.sleep(0.01)  # the reaper begins the straggler's grace
    clock.advance(59.0)
    assert not fan.wait_reapers(timeout_s=0.05) and fan.stats.killed == 0  # still in its grace
    clock.advance(1.0)
    assert fan.wait_reapers(timeout_s=3) and fan.stats.killed == 1 and fan.inflight == 0


def test_a_tasks_deadline_is_the_sooner_of_its_timeout_and_the_requests() -> None:
    fan = engine()
    budgets = {}

    def record(name: str) -> Callable[[Deadline], str]:
        def call(deadline: Deadline) -> str:
            budgets[name] = deadline.remaining_s()
            return name

        return call

    fan.run(
        [
            task("short", record("short"), timeout_ms=50),
            task("long", record("long"), timeout_ms=60_000),
        ],
        within(400),
    )
    assert budgets["short"] == pytest.approx(0.05, abs=0.001)
    assert 0.3 < budgets["long"] <= 0.4


def test_every_error_kind_becomes_its_outcome() -> None:
    fan = engine()
    result = fan.run(
        [
            task("unavailable", raiser(BackendUnavailable("connection refused"))),
            task("bad", raiser(BadBackendResponse("not JSON"))),
            task("slow", sleeper(5), timeout_ms=30),
            task("bug", raiser(KeyError("x" * 2000))),
            task("fine", sleeper(0)),
        ],
        within(2000),
    )
    by_name = {o.name: o for o in result.outcomes}
    assert [o.name for o in result.outcomes] == ["unavailable", "bad", "slow", "bug", "fine"]
    assert (by_name["unavailable"].status, by_name["unavailable"].retryable) == (
        TaskStatus.ERROR,
        True,
    )
    assert by_name["unavailable"].error_type == "BackendUnavailable"
    assert by_name["unavailable"].message == "connection refused"
    assert (by_name["bad"].status, by_name["bad"].retryable) == (TaskStatus.ERROR, False)
    assert (by_name["slow"].status, by_name["slow"].error_type) == (
        TaskStatus.TIMEOUT,
        "TimeoutError",
    )
    assert by_name["bug"].status is TaskStatus.ERROR and by_name["bug"].error_type == "KeyError"
    assert len(by_name["bug"].message or "") <= 500
    assert by_name["fine"].ok


def test_required_failure_cancels_siblings_and_raises() -> None:
    fan = engine(pool_size=2, queue_timeout_ms=2000)
    began = time.monotonic()
    with pytest.raises(RequiredTaskFailed) as caught:
        fan.run(
            [
                task("slow", sleeper(10.0)),
                task("must", raiser(BackendUnavailable("down"), after_s=0.02), required=True),
                task("queued", sleeper(0.01)),
            ],
            within(20_000),
        )
    assert time.monotonic() - began < 5  # "slow" would take 10 s
    failure = caught.value
    assert failure.failed.name == "must"
    statuses = {o.name: o.status for o in failure.result.outcomes}
    assert statuses == {
        "slow": TaskStatus.CANCELLED,
        "must": TaskStatus.ERROR,
        "queued": TaskStatus.CANCELLED,
    }
    assert fan.wait_reapers(timeout_s=3)
    assert fan.inflight == 0


def test_optional_failures_never_raise() -> None:
    fan = engine()
    result = fan.run(
        [task("a", raiser(BackendUnavailable("down"))), task("b", sleeper(0))], within(1000)
    )
    assert [o.status for o in result.outcomes] == [TaskStatus.ERROR, TaskStatus.OK]


def test_no_tasks_returns_at_once() -> None:
    began = time.monotonic()
    result = engine().run([], within(5000))
    # Not at its deadline (5 s): well before, with a margin a loaded machine keeps.
    assert result.outcomes == () and time.monotonic() - began < 2.5


def test_expired_deadline_times_out_without_calling() -> None:
    called = []
    result = engine().run([task("late", lambda deadline: called.append(deadline))], within(0))
    assert result.outcomes[0].status is TaskStatus.TIMEOUT
    assert called == []


def test_children_of_a_killed_request_are_still_reaped() -> None:
    fan = engine(abandon_grace_ms=50)
    request = gevent.spawn(fan.run, [task("stuck", stubborn(30))], within(10_000))
    gevent.sleep(0.05)
    assert fan.inflight == 1
    request.kill()
    assert fan.stats.abandoned == 1
    assert fan.wait_reapers(timeout_s=3)
    assert fan.inflight == 0 and fan.stats.killed == 1


def test_task_greenlets_are_reused_and_never_carry_context_over() -> None:
    fan = engine()
    leak: contextvars.ContextVar[str] = contextvars.ContextVar("leak", default="clean")
    seen: list[tuple[Any, str]] = []

    def look(deadline: Deadline) -> str:
        seen.append((gevent.getcurrent(), leak.get()))
        leak.set("dirty")  # set inside the task: must not reach the next task on this greenlet
        return "ok"

    for _ in range(3):
        assert all(
            o.ok for o in fan.run([task(f"t{i}", look) for i in range(4)], within(1000)).outcomes
        )
    greenlets = {id(g) for g, _ in seen}
    assert len(greenlets) <= 4 < len(seen)  # 12 tasks ran on at most 4 greenlets
    assert {value for _, value in seen} == {"clean"}


def test_idle_task_greenlets_are_bounded() -> None:
    runners = TaskRunners(max_idle=2)
    release = gevent.event.Event()
    done: list[int] = []

    def job(index: int) -> None:
        release.wait()
        done.append(index)

    for index in range(5):
        runners.start(job, index)
    gevent.sleep(0.01)
    assert runners.idle == 0
    release.set()
    wait_until = time.monotonic() + 2
    while len(done) < 5 and time.monotonic() < wait_until:
        gevent.sleep(0.01)
    assert sorted(done) == [0, 1, 2, 3, 4] and runners.idle == 2


def test_a_killed_straggler_ends_only_its_own_greenlet() -> None:
    fan = engine(abandon_grace_ms=30)
    # A second for the quick one: with 100 ms, a full suite's load once left it no time.
    result = fan.run([task("stuck", stubborn(30)), task("quick", sleeper(0))], within(1000))
    assert [o.status for o in result.outcomes] == [TaskStatus.TIMEOUT, TaskStatus.OK]
    assert fan.wait_reapers(timeout_s=3) and fan.stats.killed == 1
    # The engine goes on serving on the runners that are left (and new ones).
    again = fan.run([task(f"t{i}", sleeper(0.01)) for i in range(5)], within(1000))
    assert all(o.ok for o in again.outcomes) and fan.inflight == 0


def test_a_failure_summary_is_written_by_its_timer_when_nothing_follows(caplog) -> None:
    """One line per interval at most, and the last failures are not lost: a timer writes
    them when no later failure does."""
    import logging

    from service.engine.summary import FailureSummary

    log = logging.getLogger("tests.summary")
    summary = FailureSummary(log, "things failed", interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="tests.summary"):
        for _ in range(3):
            summary.count("timeout", "a detail")
        summary.tally("refused")
        assert [r for r in caplog.records if "things failed" in r.getMessage()] == []
        gevent.sleep(0.4)
    (line,) = [r.getMessage() for r in caplog.records if "things failed" in r.getMessage()]
    assert "timeout x3 (e.g. a detail)" in line and "refused x1" in line, line
