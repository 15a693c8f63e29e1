"""Finished calls recorded off the hub: the held connections' calls end in callbacks of the
event loop (:mod:`service.overload.held_connections`), which must not wait on the metrics'
locks, so one greenlet records them (``rpc.server.call.duration``)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import gevent
from gevent import GreenletExit
from gevent.hub import Waiter

from service.engine.summary import FailureSummary
from tracing.context import spawn_in_context
from tracing.spans import CallDurations

__all__ = ["FinishedCalls"]

log = logging.getLogger(__name__)


class FinishedCalls:
    """Calls that ended in callbacks of the hub, recorded by one recorder greenlet, which
    :meth:`ended` wakes. Callbacks may call :meth:`ended`; :meth:`close` once, at the end."""

    def __init__(self, durations: CallDurations) -> None:
        self._durations = durations
        self._finished: list[tuple[str, str, float]] = []
        self._recorder: Optional[Any] = None
        self._recorder_waiting: Optional[Waiter] = None
        # A failure per call would be a log line per call: one summary per interval instead.
        self._unrecorded = FailureSummary(log, "held calls not recorded")

    def ended(self, method: str, error_type: str, seconds: float) -> None:
        """A call to ``method`` ended after ``seconds``, answered with ``error_type``."""
        self._finished.append((method, error_type, seconds))
        if self._recorder is None:
            # Once: a greenlet spawned per call costs a stack mapped and unmapped (8 us).
            self._recorder = spawn_in_context(self._record_finished)
        elif self._recorder_waiting is not None:
            waiter, self._recorder_waiting = self._recorder_waiting, None
            waiter.switch(None)

    def close(self) -> None:
        """End the recorder once it has recorded what finished (the server has drained)."""
        self._record_pending()  # here, in case the recorder never started
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            gevent.kill(recorder)
        self._unrecorded.flush()

    def _record_finished(self) -> None:
        """The recorder: records what has finished, then waits to be woken for more."""
        try:
            while True:
                self._record_pending()
                self._recorder_waiting = Waiter()
                self._recorder_waiting.get()
        except GreenletExit:
            self._recorder_waiting = None
            self._record_pending()

    def _record_pending(self) -> None:
        while self._finished:
            finished, self._finished = self._finished, []
            for method, error_type, seconds in finished:
                try:
                    self._durations.call_ended(method, error_type, seconds)
                except Exception as exc:  # a metrics bug must not stop the recording
                    self._unrecorded.count(type(exc).__name__, error=exc)
