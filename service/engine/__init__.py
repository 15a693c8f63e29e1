"""The fan-out engine: run one request's tasks in parallel, bounded, within its deadline.

    fanout.py     FanOut: slots, waiting, abandoning and reaping; one instance per process
    outcomes.py   Task, TaskOutcome, TaskStatus, FanOutResult and the engine's errors
    context.py    RequestContext, the explicit context object of one call
    deadline.py   Deadline, a point on the monotonic clock
    runners.py    TaskRunners, reused greenlets that run each job in a copy of its context
    settings.py   FanOutSettings, the ``[fanout]`` section

It knows nothing of Thrift, MongoDB or HTTP: a task is a callable taking its budget.
"""

from service.engine.context import RequestContext
from service.engine.deadline import Deadline
from service.engine.fanout import FanOut, FanOutStats
from service.engine.outcomes import (FanOutError, FanOutOverloaded, FanOutResult,
                                     RequiredTaskFailed, Task, TaskOutcome, TaskStatus)
from service.engine.settings import FanOutSettings

__all__ = ["FanOut", "FanOutStats", "FanOutSettings", "RequestContext", "Deadline", "Task",
           "TaskOutcome", "TaskStatus", "FanOutResult", "FanOutError", "FanOutOverloaded",
           "RequiredTaskFailed"]
