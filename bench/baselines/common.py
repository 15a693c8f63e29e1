"""What the sequential and threaded baselines share with Fanout: settings, lookups, validation, mapping.

Both baselines read the same TOML settings file as ``fanout serve``, build the same
lookups (:func:`lookups.registry.default_registry` over :class:`lookups.backends.collection.Backends`),
validate requests with :func:`service.rpc.validation.validate_stats_request`, map panel
values with :mod:`service.rpc.handler`, and answer the same ``StatsResponse``. Only the
scheduling of the lookups differs, which is what the benchmark compares.

Left out, because the benchmark does not exercise them: ``required`` panels
(``PanelFailed``), the process-wide task budget (``Overloaded``), tracing (the
``trace_id`` is empty) and backend checks in ``health()`` (always ``SERVING``).
"""

from __future__ import annotations

import abc
import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lookups.base import Lookup
from lookups.deadline import Deadline
from lookups.panels import Window
from service.engine.tasks import TaskOutcome, TaskStatus
from service.idl import appstats
from service.rpc.handler import to_panel_data, to_thrift_outcomes
from service.rpc.validation import ValidRequest, validate_stats_request
from service.settings.config import Settings, load_settings

__all__ = [
    "Named",
    "PlannedLookup",
    "PlannedCall",
    "CallPlanner",
    "BaselineHandler",
    "lookup_outcome",
    "failed_outcome",
    "timeout_outcome",
    "settings_from_argv",
]

log = logging.getLogger(__name__)


class Named(Protocol):
    """What an outcome names of a lookup: a :class:`~lookups.base.Lookup`, or a peer's own."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str: ...


PlannedLookup = tuple[Any, int]  # the lookup and its timeout_ms


def settings_from_argv(prog: str, argv: Sequence[str] | None = None) -> Settings:
    """``--config FILE`` (the same TOML as ``fanout serve``), loaded and validated.

    Raises :class:`service.settings.config.ConfigError` for a bad file.
    """
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", help="TOML settings file, as for fanout serve")
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return load_settings(args.config)


def lookup_outcome(
    lookup: Lookup, window: Window, timeout_ms: int, deadline: Deadline
) -> TaskOutcome:
    """Run one lookup within ``min(timeout_ms, time left)``; every failure becomes an outcome
    (:func:`failed_outcome`)."""
    task_deadline = deadline.earlier(timeout_ms)
    if task_deadline.expired:
        return timeout_outcome(lookup, 0.0, "no time left before the request deadline")
    started = time.monotonic()
    try:
        value = to_panel_data(lookup.fetch(window, task_deadline))
    except Exception as exc:  # every lookup failure becomes an outcome
        return failed_outcome(lookup, exc, (time.monotonic() - started) * 1000.0)
    return TaskOutcome(
        lookup.name,
        lookup.source,
        TaskStatus.OK,
        (time.monotonic() - started) * 1000.0,
        value=value,
    )


def failed_outcome(lookup: Named, exc: Exception, elapsed_ms: float) -> TaskOutcome:
    """The outcome of ``lookup`` failing with ``exc``, as Fanout's engine makes it
    (:meth:`TaskOutcome.failed`). An error no lookup declares is logged with its
    traceback."""
    timed_out = isinstance(exc, TimeoutError)
    if timed_out or hasattr(exc, "retryable"):
        log.warning("task %s failed: %s: %s", lookup.name, type(exc).__name__, exc)
    else:
        log.error("task %s raised an unexpected error", lookup.name, exc_info=exc)
    return TaskOutcome.failed(lookup.name, lookup.source, exc, elapsed_ms)


def timeout_outcome(lookup: Named, elapsed_ms: float, message: str) -> TaskOutcome:
    return TaskOutcome(
        lookup.name,
        lookup.source,
        TaskStatus.TIMEOUT,
        elapsed_ms,
        error_type="TIMEOUT",
        message=message,
        retryable=True,
    )


@dataclass
class PlannedCall:
    """One ``get_app_stats`` call of a baseline, between its plan and its answer."""

    valid: ValidRequest
    deadline: Deadline
    planned: list[PlannedLookup]
    settled: dict[str, TaskOutcome]  # the panels answered without running (disabled)
    started: float  # time.monotonic() as the call arrived

    @property
    def window(self) -> Window:
        return self.valid.window

    def answer(self, outcomes: Sequence[TaskOutcome]) -> Any:
        """The ``StatsResponse``: ``outcomes`` of the planned lookups and the settled ones."""
        by_name = {**self.settled, **{outcome.name: outcome for outcome in outcomes}}
        ordered = [by_name[name] for name in self.valid.panels]
        return appstats.StatsResponse(
            app=self.valid.window.app,
            panels={o.name: o.value for o in ordered if o.ok},
            outcomes=to_thrift_outcomes(ordered),
            trace_id="",
            elapsed_ms=round((time.monotonic() - self.started) * 1000.0, 3),
        )


class CallPlanner:
    """What every baseline does with a call before and after its lookups run."""

    def __init__(self, settings: Settings, lookups: Mapping[str, Any]) -> None:
        """``lookups`` by panel name: :class:`~lookups.base.Lookup` or a peer's own kind."""
        self._settings = settings
        self._lookups = dict(lookups)

    def enabled_panels(self) -> list[str]:
        return [name for name in self._lookups if self._settings.lookup(name).enabled]

    def health_now(self) -> Any:
        """Always ``SERVING``: the baselines check no backend."""
        return appstats.Health(state=appstats.ServingState.SERVING, backends=[])

    def plan(self, request: Any) -> PlannedCall:
        """The call's window, deadline and lookups to run, its disabled panels settled.

        Raises ``InvalidRequest`` for bad input."""
        started = time.monotonic()
        valid = validate_stats_request(
            request, list(self._lookups), self.enabled_panels(), self._settings.fanout
        )
        planned, settled = [], {}
        for name in valid.panels:
            lookup = self._lookups[name]
            if self._settings.lookup(name).enabled:
                planned.append((lookup, self._settings.task_timeout_ms(name)))
            else:
                settled[name] = TaskOutcome(
                    name, lookup.source, TaskStatus.SKIPPED, 0.0, message="disabled on this server"
                )
        deadline = Deadline.after_ms(valid.deadline_ms)
        return PlannedCall(valid, deadline, planned, settled, started)


class BaselineHandler(CallPlanner, abc.ABC):
    """The AppStats handler of a baseline; subclasses say how the planned lookups run."""

    def ping(self) -> str:
        return "pong"

    def panels(self) -> list[str]:
        return self.enabled_panels()

    def health(self) -> Any:
        return self.health_now()

    def get_app_stats(self, request: Any) -> Any:
        """Gather the requested panels. Raises ``InvalidRequest`` for bad input."""
        call = self.plan(request)
        return call.answer(self.gather(call.window, call.planned, call.deadline))

    @abc.abstractmethod
    def gather(
        self, window: Window, planned: Sequence[PlannedLookup], deadline: Deadline
    ) -> list[TaskOutcome]:
        """One outcome per planned lookup, all settled by ``deadline``."""
