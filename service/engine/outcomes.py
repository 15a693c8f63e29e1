"""Tasks, their typed outcomes, and the errors the fan-out engine raises.

    FanOutError                 base class; raised only by FanOut.run
     +-- FanOutOverloaded       no task of the request could get a slot; retry later
     +-- RequiredTaskFailed     a task marked required did not finish OK; siblings were cancelled

Task failures are never raised: each becomes a :class:`TaskOutcome`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from lookups.deadline import Deadline
from typing import Any, Callable, Optional

__all__ = ["TaskStatus", "Task", "TaskOutcome", "FanOutResult", "FanOutError",
           "FanOutOverloaded", "RequiredTaskFailed"]


class TaskStatus(enum.Enum):
    """What happened to one task. Names match the Thrift ``TaskStatus`` enum."""

    OK = "OK"                # finished with a value
    ERROR = "ERROR"          # raised an exception
    TIMEOUT = "TIMEOUT"      # its timeout or the request deadline passed
    CANCELLED = "CANCELLED"  # a required sibling failed first
    REJECTED = "REJECTED"    # no pool slot within fanout.queue_timeout_ms
    SKIPPED = "SKIPPED"      # not run (e.g. disabled by configuration)


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


@dataclass(frozen=True)
class TaskOutcome:
    """The one result every task yields, whatever happened."""

    name: str
    source: str
    status: TaskStatus
    elapsed_ms: float
    value: Any = None
    error_type: Optional[str] = None
    message: Optional[str] = None
    retryable: bool = False
    pool_wait_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is TaskStatus.OK


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
        super().__init__(f"required task {failed.name!r} ended {failed.status.value}"
                         + (f": {failed.message}" if failed.message else ""))
        self.failed = failed
        self.result = result
