"""What the engine takes and gives: a call's context, its tasks, their typed outcomes.

:meth:`FanOut.run <service.engine.fanout.FanOut.run>` takes a :class:`RequestContext`
(the explicit context object of one call, made by the handler) and a list of
:class:`Task`; it gives one :class:`TaskOutcome` per task, in a :class:`FanOutResult`,
and records each outcome's duration (``fanout.task.duration``, by task name, source
and status; ``fanout_task_duration_seconds_*`` in Prometheus). Lookups get no context
object: each receives its :class:`Deadline`, which cannot go stale.

The errors the engine raises::

    FanOutError                 base class; raised only by FanOut.run
     +-- FanOutOverloaded       no task of the request could get a slot; retry later
     +-- RequiredTaskFailed     a task marked required did not finish OK; siblings were cancelled

Task failures are never raised: each becomes a :class:`TaskOutcome`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opentelemetry import metrics

from lookups.clock import SYSTEM_CLOCK, Clock
from lookups.deadline import Deadline

__all__ = [
    "RequestContext",
    "new_request_id",
    "current_request_id",
    "TaskStatus",
    "Task",
    "TaskOutcome",
    "FanOutResult",
    "FanOutError",
    "FanOutOverloaded",
    "RequiredTaskFailed",
    "task_ended",
]

#: The request id of the call being served, for its log lines (service.operations.logs):
#: each call runs in a context of its own, and its tasks in copies of it.
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "fanout_request_id", default=""
)


def new_request_id() -> str:
    """A short random id for a call that brought none."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class RequestContext:
    """One RPC: its id, method, :class:`Deadline` and the caller's propagation headers.

    ``headers`` are the caller's W3C ``traceparent``, ``tracestate`` and ``baggage``;
    ``deadline`` bounds all work done for the call.
    """

    request_id: str
    method: str
    deadline: Deadline
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def start(
        cls,
        method: str,
        deadline_ms: float,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> RequestContext:
        """A context for a call starting now on ``clock``, due ``deadline_ms`` from now."""
        return cls(
            request_id or new_request_id(),
            method,
            Deadline.after_ms(deadline_ms, clock),
            MappingProxyType(dict(headers or {})),
        )

    def by(self, deadline: Deadline) -> RequestContext:
        """This call by ``deadline``: the admitted call's, which says its place in the
        backends' lines."""
        return dataclasses.replace(self, deadline=deadline)

    def __repr__(self) -> str:
        return (
            f"<RequestContext {self.method} id={self.request_id} "
            f"remaining={self.deadline.remaining_ms():.0f}ms>"
        )


class TaskStatus(enum.Enum):
    """What happened to one task. Names match the Thrift ``TaskStatus`` enum."""

    OK = "OK"  # finished with a value
    ERROR = "ERROR"  # raised an exception
    TIMEOUT = "TIMEOUT"  # its timeout or the request deadline passed
    CANCELLED = "CANCELLED"  # a required sibling failed first
    REJECTED = "REJECTED"  # no pool slot within fanout.queue_timeout_ms
    SKIPPED = "SKIPPED"  # not run (e.g. disabled by configuration)


@dataclass(frozen=True)
class Task:
    """One unit of work: ``call(deadline)`` returns a value or raises.

    ``deadline`` is the sooner of ``timeout_ms`` from its start and the request's
    deadline; the callee must push it into its I/O so the library gives up by itself.
    """

    name: str
    source: str
    call: Callable[[Deadline], Any]
    timeout_ms: int
    required: bool = False
    #: Marked optional (``[lookups.<name>] optional``): shed first under load, and left out
    #: of the essential panels' SLI (deploy/monitoring/slos.yaml).
    optional: bool = False


#: Characters of an exception's message an outcome carries.
MESSAGE_LIMIT = 500


@dataclass(frozen=True)
class TaskOutcome:
    """The one result every task yields, whatever happened."""

    name: str
    source: str
    status: TaskStatus
    elapsed_ms: float
    value: Any = None
    error_type: str | None = None
    message: str | None = None
    retryable: bool = False
    pool_wait_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is TaskStatus.OK

    @classmethod
    def failed(
        cls, name: str, source: str, exc: Exception, elapsed_ms: float, pool_wait_ms: float = 0.0
    ) -> TaskOutcome:
        """The outcome of a task that raised ``exc``: ``TimeoutError`` is ``TIMEOUT``,
        anything else ``ERROR``; ``retryable`` as the exception says (a timeout is)."""
        timed_out = isinstance(exc, TimeoutError)
        return cls(
            name,
            source,
            TaskStatus.TIMEOUT if timed_out else TaskStatus.ERROR,
            elapsed_ms,
            error_type=type(exc).__name__,
            message=(str(exc) or type(exc).__name__)[:MESSAGE_LIMIT],
            retryable=bool(getattr(exc, "retryable", timed_out)),
            pool_wait_ms=pool_wait_ms,
        )


@dataclass(frozen=True)
class FanOutResult:
    """All outcomes of one run, in task order."""

    outcomes: tuple[TaskOutcome, ...]
    elapsed_ms: float


class FanOutError(Exception):
    """Base class of the errors :meth:`FanOut.run` raises."""


class FanOutOverloaded(FanOutError):
    """Raised when the call is refused (:mod:`service.overload.gate`) or not one task of the
    request could get a pool slot; ``retry_after_ms`` (0: not decided yet) tells when
    to come back, which the gate fills in."""

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class RequiredTaskFailed(FanOutError):
    """Raised when a required task did not finish OK; ``result`` holds every outcome."""

    def __init__(self, failed: TaskOutcome, result: FanOutResult) -> None:
        super().__init__(
            f"required task {failed.name!r} ended {failed.status.value}"
            + (f": {failed.message}" if failed.message else "")
        )
        self.failed = failed
        self.result = result


_meter = metrics.get_meter("fanout.engine")
_task_duration = _meter.create_histogram(
    "fanout.task.duration", unit="s", description="Time from a task's start to its outcome"
)


def task_ended(task: Task, outcome: TaskOutcome) -> None:
    """Record one task's duration and final status."""
    _task_duration.record(
        outcome.elapsed_ms / 1000.0,
        {
            "fanout.task.name": task.name,
            "fanout.task.source": task.source,
            "fanout.task.status": outcome.status.value,
            "fanout.task.optional": task.optional,
        },
    )
