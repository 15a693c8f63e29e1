"""FanOut: run one request's tasks in parallel, bounded, within its deadline.

Each task runs in its own greenlet (a reused one, see
:class:`~tracing.context.TaskRunners`), in a copy of the request's contextvars
context (so the request context and the current span reach it), holding one
slot of the request's pool (``fanout.pool_size``) and one of the process-wide
budget (``fanout.max_inflight_tasks``). Waiting for slots is bounded by
``fanout.queue_timeout_ms``; a task that gets none is ``REJECTED``.

The request waits until every task is settled, a required task fails, or the
deadline passes, whichever is first. Tasks still running then are *abandoned*:
their outcome is already settled (``TIMEOUT`` or ``CANCELLED``), they are
counted, and a reaper gives them ``fanout.abandon_grace_ms`` to finish on their
own (their budget was pushed into their I/O, so they normally do) before it
kills them. No task outlives its request by more than that grace.

A call comes here once admitted (:mod:`service.overload.gate`); finding the
process-wide task slots all taken, it raises :class:`FanOutOverloaded` at once
rather than queue for what is most likely a refusal anyway.

Failures are counted and logged as a summary every few seconds at most
(:mod:`service.engine.summary`), never a line per task; each outcome is recorded once
(:func:`service.engine.tasks.task_ended`). This module knows nothing of Thrift, MongoDB
or HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import gevent
from gevent import Greenlet, GreenletExit
from gevent.event import Event
from gevent.hub import get_hub
from gevent.lock import BoundedSemaphore
from greenlet import getcurrent
from greenlet import greenlet as RawGreenlet
from opentelemetry.trace import Span

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline
from service.engine.settings import FanOutSettings
from service.engine.summary import FailureSummary
from service.engine.tasks import (
    FanOutOverloaded,
    FanOutResult,
    RequestContext,
    RequiredTaskFailed,
    Task,
    TaskOutcome,
    TaskStatus,
    task_ended,
)
from tracing.context import TaskRunners, spawn_in_context
from tracing.pools import DemandMeter, MeteredSlots, PoolMeter
from tracing.spans import cut_task_span, mark_task_outcome, task_span

__all__ = ["FanOut", "FanOutStats"]

log = logging.getLogger(__name__)

_KILL_WAIT_S = 1.0  # how long the reaper waits for a killed greenlet to unwind


@dataclass
class FanOutStats:
    """Process-wide counters, for logs, health checks and tests."""

    started: int = 0
    rejected: int = 0
    abandoned: int = 0  # still running when their request answered
    killed: int = 0  # abandoned and still running after the grace period


class _Run:
    """The state of one request's fan-out. Outcomes settle once; the first one wins."""

    __slots__ = (
        "tasks",
        "deadline",
        "outcomes",
        "started_at",
        "failed_required",
        "wake",
        "_pending",
        "unfinished",
        "running",
        "ended",
        "spans",
    )

    def __init__(self, tasks: Sequence[Task], deadline: Deadline) -> None:
        self.tasks = tasks
        self.deadline = deadline
        self.outcomes: list[TaskOutcome | None] = [None] * len(tasks)
        self.started_at: list[float | None] = [None] * len(tasks)
        self.failed_required: TaskOutcome | None = None
        self.wake = Event()
        self._pending = len(tasks)
        if not tasks:
            self.wake.set()
        self.unfinished = 0  # tasks started whose body has not ended
        self.running: dict[int, RawGreenlet] = {}  # task index -> the greenlet running it
        self.ended: Event | None = None  # set once unfinished is 0, when someone waits
        self.spans: dict[int, Span] = {}  # task index -> its span, while it runs

    def task_ended(self, index: int) -> None:
        self.running.pop(index, None)
        self.unfinished -= 1
        if self.unfinished == 0 and self.ended is not None:
            self.ended.set()

    def settle(self, index: int, outcome: TaskOutcome) -> TaskOutcome:
        """Record ``outcome`` unless the task is settled already; return the one that counts."""
        current = self.outcomes[index]
        if current is not None:
            return current
        self.outcomes[index] = outcome
        self._pending -= 1
        if self.tasks[index].required and not outcome.ok and self.failed_required is None:
            self.failed_required = outcome
        if self._pending == 0 or self.failed_required is not None:
            self.wake.set()
        return outcome

    def elapsed_ms(self, index: int) -> float:
        started = self.started_at[index]
        return 0.0 if started is None else (self.deadline.now() - started) * 1000.0

    def settle_rest(self, status: TaskStatus, message: str) -> None:
        """Settle every task not settled yet; the spans of those still running end now."""
        for index, task in enumerate(self.tasks):
            if self.outcomes[index] is None:
                self.settle(
                    index,
                    TaskOutcome(
                        task.name,
                        task.source,
                        status,
                        self.elapsed_ms(index),
                        error_type=status.value,
                        message=message,
                        retryable=status is TaskStatus.TIMEOUT,
                    ),
                )
                span = self.spans.get(index)
                if span is not None:
                    cut_task_span(span, status.value, message)


class FanOut:
    """Runs the tasks of one request at a time; one instance serves the whole process."""

    def __init__(self, settings: FanOutSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        """``clock`` times the pools' meters and the failures' summary; a call's own times
        come from its deadline's."""
        self.settings = settings
        self.stats = FanOutStats()
        self._inflight = MeteredSlots(
            BoundedSemaphore(settings.max_inflight_tasks),
            PoolMeter("fanout.tasks", settings.max_inflight_tasks, clock=clock),
        )
        self.request_pool = DemandMeter("fanout.request", settings.pool_size, clock=clock)
        self._runners = TaskRunners()
        self._reapers: set[Greenlet] = set()
        self.failures = FailureSummary(log, "task failures", clock=clock)

    @property
    def inflight(self) -> int:
        """Tasks holding a process-wide slot right now."""
        return self._inflight.meter.in_use

    @property
    def pool_meters(self) -> tuple[PoolMeter, ...]:
        """The engine's pools: per request (``fanout.pool_size``) and process-wide."""
        return (self.request_pool, self._inflight.meter)

    def run(self, tasks: Sequence[Task], request: RequestContext) -> FanOutResult:
        """Run ``tasks`` for ``request`` in parallel; one outcome per task, in order. Every
        task ends by ``request.deadline``.

        Raises :class:`FanOutOverloaded` when no task could get a slot, and
        :class:`RequiredTaskFailed` when a required task did not finish OK. Every other
        failure is an outcome, never an exception.
        """
        return self._run(tasks, request.deadline, request.deadline.now())

    def _run(self, tasks: Sequence[Task], deadline: Deadline, started: float) -> FanOutResult:
        run = _Run(tasks, deadline)
        try:
            self._start_all(run)
            deadline.wait(run.wake)
        finally:
            # Also when the caller itself is killed mid-wait: its children still get reaped.
            self._abandon_stragglers(run)
        if run.failed_required is not None:
            run.settle_rest(
                TaskStatus.CANCELLED, f"required task {run.failed_required.name!r} failed"
            )
        else:
            run.settle_rest(TaskStatus.TIMEOUT, "request deadline passed")
        result = FanOutResult(
            tuple(o for o in run.outcomes if o is not None),
            (deadline.now() - started) * 1000.0,
        )
        # Once per outcome a caller gets, whatever became of its task: rejected, cut before
        # it ran, still running, or done (counted when it ended, some went missing).
        for task, outcome in zip(run.tasks, result.outcomes):
            task_ended(task, outcome)
        self.stats.rejected += sum(o.status is TaskStatus.REJECTED for o in result.outcomes)
        if run.failed_required is not None:
            raise RequiredTaskFailed(run.failed_required, result)
        return result

    def _start_all(self, run: _Run) -> None:
        if run.tasks and self._inflight.locked():
            # Fail fast: with the process-wide slots all taken, queueing for one only makes
            # the caller wait for what is most likely an Overloaded anyway. Past this check
            # the first task always starts (nothing yields before its two slots are taken),
            # so no call ends with every task rejected.
            raise FanOutOverloaded("no task could start: the process-wide task slots are all taken")
        self.request_pool.wanted(len(run.tasks))
        pool = BoundedSemaphore(self.settings.pool_size)
        # All tasks queue at once, so each may wait for a slot until the same moment.
        queue_until = run.deadline.earlier(self.settings.queue_timeout_ms)
        queued_at = run.deadline.now()
        for index, task in enumerate(run.tasks):
            if run.failed_required is not None:
                return  # the rest are settled CANCELLED by run()
            if not self._acquire(pool, queue_until):
                wait_ms = (run.deadline.now() - queued_at) * 1000.0
                run.settle(
                    index,
                    TaskOutcome(
                        task.name,
                        task.source,
                        TaskStatus.REJECTED,
                        wait_ms,
                        error_type="REJECTED",
                        message="no pool slot became free in time",
                        retryable=True,
                        pool_wait_ms=wait_ms,
                    ),
                )
                continue
            self.stats.started += 1
            run.started_at[index] = now = run.deadline.now()
            run.unfinished += 1
            self._runners.start(self._run_task, run, index, pool, (now - queued_at) * 1000.0)

    def _acquire(self, pool: BoundedSemaphore, until: Deadline) -> bool:
        """Take a request slot, then a process slot, waiting no later than ``until``."""
        if not pool.acquire(timeout=until.remaining_s()):
            return False
        if self._inflight.acquire(timeout=until.remaining_s()):
            return True
        pool.release()
        return False

    def _run_task(self, run: _Run, index: int, pool: BoundedSemaphore, wait_ms: float) -> None:
        task = run.tasks[index]
        run.running[index] = getcurrent()
        try:
            if run.outcomes[index] is not None:
                return  # settled before this greenlet got to run: nobody waits for its work
            with task_span(task.name, task.source, wait_ms) as span:
                run.spans[index] = span
                outcome, error = self._call(run, index, wait_ms)
                final = run.settle(index, outcome)
                # A late finisher reports what the caller was told, not what it did.
                mark_task_outcome(span, final.status.value, error if final is outcome else None)
        finally:
            run.spans.pop(index, None)
            pool.release()
            self._inflight.release()
            run.task_ended(index)

    def _call(self, run: _Run, index: int, wait_ms: float) -> tuple[TaskOutcome, Exception | None]:
        task = run.tasks[index]
        deadline = run.deadline.earlier(task.timeout_ms)
        if deadline.expired:
            return TaskOutcome(
                task.name,
                task.source,
                TaskStatus.TIMEOUT,
                0.0,
                error_type="TIMEOUT",
                message="no time left before the request deadline",
                retryable=True,
                pool_wait_ms=wait_ms,
            ), None
        try:
            value = task.call(deadline)
        except Exception as exc:  # noqa: BLE001 - every task failure becomes an outcome
            return self._failure(task, exc, run.elapsed_ms(index), wait_ms), exc
        return TaskOutcome(
            task.name,
            task.source,
            TaskStatus.OK,
            run.elapsed_ms(index),
            value=value,
            pool_wait_ms=wait_ms,
        ), None

    def _failure(
        self, task: Task, exc: Exception, elapsed_ms: float, wait_ms: float
    ) -> TaskOutcome:
        timed_out = isinstance(exc, TimeoutError)
        declared = timed_out or hasattr(exc, "retryable")
        if declared:
            self.failures.count(f"{task.name} {type(exc).__name__}", str(exc))
        else:
            self.failures.count(f"{task.name} unexpected {type(exc).__name__}", str(exc), exc)
        return TaskOutcome.failed(task.name, task.source, exc, elapsed_ms, wait_ms)

    def _abandon_stragglers(self, run: _Run) -> None:
        if run.unfinished == 0:
            return
        self.stats.abandoned += run.unfinished
        run.ended = Event()
        reaper = spawn_in_context(self._reap, run)
        self._reapers.add(reaper)
        reaper.link(self._reapers.discard)

    def _reap(self, run: _Run) -> None:
        assert run.ended is not None
        clock = run.deadline.clock  # the call's: its grace passes on the service's clock
        grace_s = self.settings.abandon_grace_ms / 1000.0
        if clock.wait(run.ended, clock.monotonic() + grace_s):
            return
        alive = list(run.running.items())
        if not alive:
            return
        self.stats.killed += len(alive)
        self.failures.count(
            "killed after the abandon grace",
            f"{len(alive)} task(s) still running "
            f"{self.settings.abandon_grace_ms} ms after their request ended",
        )
        loop = get_hub().loop
        for index, runner in alive:
            loop.run_callback(_kill_task, run, index, runner)
        # The kills' delivery by the event loop, not a policy of the service: real time.
        run.ended.wait(timeout=_KILL_WAIT_S)

    def wait_reapers(self, timeout_s: float) -> bool:
        """Wait for abandoned tasks to end (used at shutdown and by tests); True if all did."""
        gevent.joinall(list(self._reapers), timeout=timeout_s)
        return not self._reapers


def _kill_task(run: _Run, index: int, runner: RawGreenlet) -> None:
    """Raise ``GreenletExit`` in ``runner`` if it is still running task ``index`` of ``run``.

    Runs in the hub, so the check and the throw happen with no switch in between:
    a runner that finished this task meanwhile may already run another request's.
    """
    running = run.running.get(index)
    if running is not None and running is runner:
        running.throw(GreenletExit)
