"""The fan-out engine: run one request's tasks in parallel, bounded, within its deadline.

    fanout.py     FanOut: slots, waiting, abandoning and reaping; one instance per process
    tasks.py      what it takes and gives: RequestContext (the explicit context object of
                  one call), Task, TaskOutcome, TaskStatus, FanOutResult, the engine's errors
    settings.py   FanOutSettings, the ``[fanout]`` section

It knows nothing of Thrift, MongoDB or HTTP: a task is a callable taking its budget.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, not on import: nothing is loaded that the caller does not use.
_EXPORTS = {
    "FanOut": "fanout",
    "FanOutStats": "fanout",
    "FanOutSettings": "settings",
    "RequestContext": "tasks",
    "Deadline": "lookups.deadline",
    "Task": "tasks",
    "TaskOutcome": "tasks",
    "TaskStatus": "tasks",
    "FanOutResult": "tasks",
    "FanOutError": "tasks",
    "FanOutOverloaded": "tasks",
    "RequiredTaskFailed": "tasks",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    path = module if "." in module else f"{__name__}.{module}"
    return getattr(importlib.import_module(path), name)
