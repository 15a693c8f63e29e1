"""Failures counted, then logged as one summary line every few seconds at most.

Under overload every call may be refused and every task may fail; a log line
each would cost more than the refusal and drown the log. :class:`FailureSummary`
counts by kind (``"Overloaded"``, ``"task alerts TIMEOUT"``, ...) and writes at
most one WARNING per ``interval_s`` naming the counts since the last one. The
first occurrence of a kind that was not seen in the previous interval is part
of the next summary, never lost: a timer writes the line when no later failure
does, and :meth:`flush` writes what is pending (at shutdown). Every failure stays visible per call
in outcomes, spans and metrics.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from gevent.hub import get_hub

from lookups.clock import SYSTEM_CLOCK, Clock
from tracing.context import spawn_in_context

__all__ = ["FailureSummary"]

#: Kinds named in one line; the rest are summed as "and N more kinds".
_KINDS_SHOWN = 12


class FailureSummary:
    """Counts failures by kind; logs a summary at most once per ``interval_s`` of ``clock``
    (the service's where it has one), or by a timer of the hub's loop when nothing more
    comes."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = 5.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        self._log = logger
        self._what = what
        self._interval_s = interval_s
        self._counts: Counter[str] = Counter()
        self._examples: dict[str, str] = {}
        self._since = self._clock.monotonic()
        self._timer: Any | None = None
        self.total = 0

    def count(
        self, kind: str, detail: object | None = None, error: BaseException | None = None
    ) -> None:
        """One failure of ``kind``. ``detail`` (one example) is kept for the next line;
        it is formatted with ``str`` only then, not on every call.

        ``error``, for failures nobody declared (bugs), is logged at ERROR with its
        stack trace the first time its kind occurs in an interval.
        """
        if error is not None and kind not in self._counts:
            self._log.error(
                "%s: %s (later ones in the next %.0f s are counted)",
                self._what,
                kind,
                self._interval_s,
                exc_info=error,
            )
        self.tally(kind, detail)
        if self._clock.monotonic() - self._since >= self._interval_s:
            self.flush()

    def tally(self, kind: str, detail: object | None = None) -> None:
        """:meth:`count` without ever logging here: the line is left to the timer. Safe
        in a callback of the hub's loop, which must not block."""
        self._counts[kind] += 1
        self.total += 1
        if detail is not None and kind not in self._examples:
            self._examples[kind] = str(detail)[:200]
        if self._timer is None:
            # Nothing may come after this failure: a timer writes the line all the same.
            self._timer = get_hub().loop.timer(self._interval_s)
            self._timer.start(spawn_in_context, self.flush)

    def flush(self) -> None:
        """Log what was counted since the last line, if anything."""
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        now = self._clock.monotonic()
        counts, self._counts = self._counts, Counter()
        examples, self._examples = self._examples, {}
        elapsed, self._since = now - self._since, now
        if not counts:
            return
        parts = [
            f"{kind} x{n}" + (f" (e.g. {examples[kind]})" if kind in examples else "")
            for kind, n in counts.most_common(_KINDS_SHOWN)
        ]
        rest = len(counts) - _KINDS_SHOWN
        if rest > 0:
            parts.append(f"and {rest} more kinds")
        self._log.warning("%s in the last %.1f s: %s", self._what, elapsed, "; ".join(parts))
