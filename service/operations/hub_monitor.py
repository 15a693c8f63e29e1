"""Report greenlet runs that block the event loop longer than ``server.hub_block_threshold_ms``.

A greenlet that computes for a long time, or calls something blocking that
gevent did not patch, stops every other connection and task of the process.
:class:`HubMonitor` reports each such run once, after it ends:

* a WARNING log line: how long the loop was blocked, by which greenlet, in
  which span, and the blocked greenlet's stack taken *while* it was blocking. A place
  (the innermost frame) gets that line once per :data:`STACK_INTERVAL_S`; its later
  blocks are summed up in one line per :data:`SUMMARY_INTERVAL_S` at most, so a busy
  host's log is not all stacks;
* the ``fanout_event_loop_blocked_total`` counter (every block, logged or not);
* a ``hub.blocked`` span event (``blocked_ms``, ``threshold_ms``, ``greenlet``,
  ``location``, ``span``: the name of the span current while blocked) on the span that was current
  in the blocked greenlet (a task's
  or a request's), or, if that span ended meanwhile, on its nearest open parent.

How, and what it costs:

* gevent's compiled ``HubSwitchTracer`` (the tracer behind gevent's own
  ``monitor_thread``) runs on every greenlet switch: it records the greenlet
  switched to and, on a switch into the hub, the time: a few instructions a switch.
* The looks are a timer signal (``SIGALRM`` from ``setitimer``), not a thread: the
  handler runs in the event loop's own thread, between two bytecodes of whatever runs
  there, every quarter threshold (at least 5 ms) while the loop runs greenlets. A thread
  that woke that often had to take the GIL from the loop each time, and on a busy host
  the loop then waited for that thread to be scheduled: a loaded server lost a share of
  its throughput to it (the ``cpu`` scenario's rows with the monitor on and off give
  it). A blocking system call that gevent did not patch (``time.sleep``, a
  blocking ``recv``) is interrupted by the signal, and Python runs the handler inside
  it, so the stack is still the blocked one; a long computation inside one C call is
  looked at when it returns. Each signal that finds the loop waiting in the hub wakes
  the process, so the looks follow what they find: one that finds a greenlet running
  sets the timer to a quarter threshold; one that finds the loop resting in the hub after
  a run (a server between calls at a light load) doubles it, up to one threshold; and
  while the loop sits idle, where nothing can block, each look doubles it, up to
  :data:`IDLE_PERIOD_THRESHOLDS` thresholds, and a look that finds it resting after a
  brief run (a timer, a health check) keeps that pace. When the hub has not run for
  longer than the threshold, the handler takes the interrupted stack (without reading
  any source line) and the blocked greenlet's current span, and hands them to the hub
  with ``loop.run_callback``; the report runs there as soon as the loop runs again.
  Nothing is logged or recorded from the handler itself: it may have interrupted a
  logging call or a span's own lock.
* So the monitor needs ``SIGALRM``, in the main thread: where the loop runs in another
  thread, or something else handles ``SIGALRM`` (``pytest-timeout``'s signal method),
  it does not start and says so once.
* The current span per greenlet comes from a span processor on the global SDK tracer
  provider (:class:`_GreenletSpans`): a dict update per span start and end, only for
  recorded spans, so that a block is put on the nearest span still open when it is
  reported. Without an SDK provider there are no span events.

A run between one threshold and one and a quarter thresholds long may end
before the monitor looks and go unreported (up to two thresholds where the looks find
the loop resting: a light load); longer ones are always reported, except
that the first run after an idle spell (or one of a few brief runs a second) may go
unseen up to one idle period longer (:data:`IDLE_PERIOD_THRESHOLDS` thresholds): a
server at rest has had little to block, and one at work, found running greenlets, is
looked at every quarter threshold.

Why not gevent's own monitor thread (``gevent.config.monitor_thread`` with
``max_blocking_time``, which baseplate.py listens to through ``EventLoopBlocked``):
its event carries the configured threshold, not how long the loop was really
blocked; it is sent from the monitor thread while the block is still going on, so
a listener can neither log through the process's handlers safely nor add a span
event; it checks once per threshold, so a block may run to twice the threshold
before it is seen; and it prints a greenlet-tree report to stderr per block
unless ``print_blocking_reports`` is turned off for the whole process. We reuse
its switch tracer (``gevent._tracer``, private: tests/test_hub_monitor.py fails
if a gevent upgrade moves it) and add measured durations and span attribution.
One monitor per process: a second :meth:`HubMonitor.start` is a no-op (logged).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import greenlet
from gevent import get_hub, spawn_raw
from gevent._tracer import HubSwitchTracer
from gevent.monkey import get_original
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from lookups.clock import SYSTEM_CLOCK
from service.engine.summary import FailureSummary

__all__ = ["HubMonitor", "BLOCKED_EVENT", "Look", "next_wait"]

log = logging.getLogger(__name__)

#: Name of the span event added for a blocked run.
BLOCKED_EVENT = "hub.blocked"
#: A place's stack is logged at most once in this long; its later blocks are counted.
STACK_INTERVAL_S = 600.0
#: The blocks counted, not logged, are summed up in one line at most this often.
SUMMARY_INTERVAL_S = 60.0

_STACK_FRAMES = 8  # innermost frames of the blocked stack kept in the report
_MIN_PERIOD_S = 0.005  # the monitor never looks more often than this
#: While the loop stays idle, the monitor looks once per this many thresholds at most.
IDLE_PERIOD_THRESHOLDS = 10
_MAX_OPEN_SPANS = 100_000  # a bound on the span registry, against spans never ended

# The standard library's, not gevent's wrapper (which only adds SIGCHLD handling).
_set_handler = get_original("signal", "signal")


class _GreenletSpans(SpanProcessor):
    """The innermost open span of each greenlet, readable from the signal's handler.

    Inactive (every hook returns at once) while no monitor uses it.
    """

    def __init__(self) -> None:
        self.users = 0
        self._open: dict[int, tuple[Span, Any]] = {}  # span id -> (span, greenlet that started it)
        self._innermost: dict[Any, Span] = {}  # greenlet -> its innermost open span

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        if not self.users:
            return
        current = greenlet.getcurrent()
        self._open[span.get_span_context().span_id] = (span, current)
        self._innermost[current] = span
        if len(self._open) > _MAX_OPEN_SPANS:
            self.clear()  # spans that never end (a bug elsewhere) must not grow this forever

    def on_end(self, span: ReadableSpan) -> None:
        if not self.users:
            return
        entry = self._open.pop(span.context.span_id, None)
        if entry is None:
            return
        ended, owner = entry
        if self._innermost.get(owner) is not ended:
            return
        outer = self._open.get(span.parent.span_id) if span.parent is not None else None
        if outer is not None and outer[1] is owner:
            self._innermost[owner] = outer[0]
        else:
            del self._innermost[owner]

    def innermost(self, owner: Any) -> Span | None:
        """The innermost open span started by greenlet ``owner``."""
        return self._innermost.get(owner)

    def nearest_recording(self, span: Span | None) -> Span | None:
        """``span`` if still open, else its nearest ancestor still open, else None."""
        while span is not None and not span.is_recording():
            parent = span.parent
            entry = self._open.get(parent.span_id) if parent is not None else None
            span = entry[0] if entry is not None else None
        return span

    def clear(self) -> None:
        self._open.clear()
        self._innermost.clear()


_SPANS = _GreenletSpans()
_attached_to: list[Any] = []  # the provider _SPANS was added to (processors cannot be removed)
_active: dict[int, HubMonitor] = {}  # pid -> the monitor running in that process


def _attach_span_registry() -> bool:
    """Add :data:`_SPANS` to the global SDK tracer provider, once; False if there is none."""
    provider = trace.get_tracer_provider()
    if _attached_to and _attached_to[0] is provider:
        return True
    add = getattr(provider, "add_span_processor", None)
    if add is None:
        return False
    add(_SPANS)
    _attached_to[:] = [provider]
    return True


class Look(enum.Enum):
    """What a look found the loop doing since the last one."""

    IDLE = "idle"  # in the hub, and nothing ran since the last look
    RESTING = "resting"  # in the hub, after running something since
    BUSY = "busy"  # running a greenlet (blocked, perhaps)


@dataclass
class _Watch:
    """The state of one :meth:`HubMonitor.start`, read and written by its looks."""

    tracer: Any
    hub: Any
    key: int  # its key in _active
    threshold_s: float
    period_s: float
    running: bool = True
    uses_spans: bool = False  # counted in _SPANS.users
    reported_entry: float = 0.0  # hub entry time of the last run reported
    seen_entry: float = 0.0  # hub entry time at the monitor's last look
    waiting_s: float = 0.0  # the timer's interval now


@dataclass(frozen=True)
class _Block:
    """One blocked run, as a look saw it."""

    greenlet: Any
    entered_hub: float  # SYSTEM_CLOCK.monotonic() when the hub last ran before the block
    stack: traceback.StackSummary | None
    span: Span | None


def next_wait(looked: Look, waiting_s: float, period_s: float, threshold_s: float) -> float:
    """The timer's next interval after a look that found ``looked``.

    A look that finds the loop waiting wakes the process: look as often as what is found
    asks. A loop found running greenlets is looked at every ``period_s``; one resting
    between runs less, doubling up to once a threshold (a longer wait, from idle, is
    kept); an idle loop cannot block: doubling up to once an idle period.
    """
    if looked is Look.BUSY:
        return period_s
    if looked is Look.RESTING:
        return max(waiting_s, min(waiting_s * 2, threshold_s))
    return min(waiting_s * 2, threshold_s * IDLE_PERIOD_THRESHOLDS)


@dataclass(frozen=True)
class _AlarmHandler:
    """``SIGALRM``'s handler while a monitor runs: one look."""

    monitor: HubMonitor
    watch: _Watch

    def __call__(self, signum: int, frame: Any) -> None:
        self.monitor._look(self.watch, frame)


class HubMonitor:
    """Reports event-loop blocks longer than ``threshold_ms``; ``threshold_ms`` 0 disables it.

    Call :meth:`start` and :meth:`stop` in the main thread, whose event loop it watches.
    """

    def __init__(self, threshold_ms: int) -> None:
        if threshold_ms < 0:
            raise ValueError(f"threshold_ms must be >= 0, got {threshold_ms}")
        self.threshold_ms = threshold_ms
        self._watch: _Watch | None = None
        self._reported = 0
        # Where the stack was last logged, by location: on a busy host the same few places
        # block again and again, and a full report each time drowned every other line.
        self._stack_logged_at: dict[str, float] = {}
        self._summary = FailureSummary(
            log, "event loop blocked again where its stack was logged", SUMMARY_INTERVAL_S
        )

    @property
    def running(self) -> bool:
        return self._watch is not None

    @property
    def blocks_reported(self) -> int:
        """Blocked runs reported since construction."""
        return self._reported

    def start(self) -> HubMonitor:
        """Install the switch tracer and the timer signal's handler; a no-op when disabled,
        already running, when another monitor runs in this process, or when the signal
        cannot be ours (not the main thread, or ``SIGALRM`` handled by something else)."""
        if self.threshold_ms == 0 or self._watch is not None:
            return self
        key = os.getpid()  # a forked child has a monitor of its own to start
        if key in _active:
            log.info("hub monitor: one is already running in this process; not starting another")
            return self
        previous = signal.getsignal(signal.SIGALRM)
        # A handler of ours in a forked child is its parent's: it is replaced.
        if previous not in (signal.SIG_DFL, None) and not isinstance(previous, _AlarmHandler):
            log.warning("hub monitor: SIGALRM is handled by something else; not starting")
            return self
        hub = get_hub()
        threshold_s = self.threshold_ms / 1000.0
        watch = _Watch(
            HubSwitchTracer(hub, threshold_s),
            hub,
            key,
            threshold_s,
            max(threshold_s / 4, _MIN_PERIOD_S),
        )
        try:
            _set_handler(signal.SIGALRM, _AlarmHandler(self, watch))
        except ValueError:  # only the main thread may handle signals
            watch.tracer.kill()
            log.warning("hub monitor: its event loop is not the main thread's; not starting")
            return self
        if _attach_span_registry():
            watch.uses_spans = True
            _SPANS.users += 1
        self._watch, _active[key] = watch, self
        watch.waiting_s = watch.period_s
        signal.setitimer(signal.ITIMER_REAL, watch.waiting_s)
        log.info("hub monitor: reporting event-loop blocks over %d ms", self.threshold_ms)
        return self

    @property
    def waiting_s(self) -> float:
        """The timer's interval between looks now: its period while the loop is
        busy, up to :data:`IDLE_PERIOD_THRESHOLDS` thresholds while it is idle (0 before
        :meth:`start`)."""
        return self._watch.waiting_s if self._watch is not None else 0.0

    def flush(self) -> None:
        """Log the summary of the blocks counted since the last one (at shutdown)."""
        self._summary.flush()

    def stop(self) -> None:
        """Stop reporting, remove the tracer and the signal's handler; idempotent."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        self._summary.flush()
        watch.running = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        # start took SIGALRM only from the default (or a forked parent's handler of ours).
        _set_handler(signal.SIGALRM, signal.SIG_DFL)
        _active.pop(watch.key, None)
        if watch.uses_spans:
            _SPANS.users -= 1
            if not _SPANS.users:
                _SPANS.clear()
        if greenlet.gettrace() is watch.tracer:
            watch.tracer.kill()
        else:  # a tracer installed after ours chains to ours; removing ours would drop it
            log.warning(
                "hub monitor: another greenlet tracer was installed later; ours stays chained"
            )

    def _look(self, watch: _Watch, frame: Any) -> None:
        """The timer signal's handler: runs in the loop's thread, in whatever ran there."""
        if not watch.running:
            return
        try:
            looked = self._check(watch, frame)
            watch.waiting_s = next_wait(looked, watch.waiting_s, watch.period_s, watch.threshold_s)
        except Exception as exc:  # noqa: BLE001 - a bug here must not break what it interrupted
            watch.hub.loop.run_callback(log.error, "hub monitor: a look failed: %r", exc)
        finally:
            if watch.running:
                signal.setitimer(signal.ITIMER_REAL, watch.waiting_s)

    def _check(self, watch: _Watch, frame: Any) -> Look:
        """Report a block going on (``frame``: where the signal interrupted it); what the
        loop did since the last look."""
        tracer = watch.tracer
        entered = tracer.last_entered_hub
        blocked = tracer.active_greenlet
        seen, watch.seen_entry = watch.seen_entry, entered
        if blocked is watch.hub:
            return Look.IDLE if entered == seen else Look.RESTING
        if blocked is None or not entered or entered == watch.reported_entry:
            return Look.BUSY
        # The machine's clock, not the service's: gevent's tracer stamped ``entered`` on it.
        if SYSTEM_CLOCK.monotonic() - entered < watch.threshold_s:
            return Look.BUSY
        watch.reported_entry = entered
        # No source line read here (file I/O inside a signal handler): the report's
        # formatting reads them, in the hub.
        stack = traceback.StackSummary.extract(
            traceback.walk_stack(frame), limit=_STACK_FRAMES, lookup_lines=False
        )
        stack.reverse()
        block = _Block(blocked, entered, stack or None, _SPANS.innermost(blocked))
        watch.hub.loop.run_callback(self._report, watch, block)
        return Look.BUSY

    def _report(self, watch: _Watch, block: _Block) -> None:
        """Runs in the hub, right after the blocked run ended."""
        if not watch.running:
            return
        self._reported += 1
        blocked_ms = (SYSTEM_CLOCK.monotonic() - block.entered_hub) * 1000.0
        name = _greenlet_name(block.greenlet)
        location = _location(block.stack)
        span = _SPANS.nearest_recording(block.span)
        if span is not None:
            try:
                span.add_event(
                    BLOCKED_EVENT,
                    {
                        "blocked_ms": round(blocked_ms, 1),
                        "threshold_ms": self.threshold_ms,
                        "greenlet": name,
                        "location": location,
                        "span": block.span.name if block.span is not None else "",
                    },
                )
            except Exception:  # tracing must never break the process; the log line still goes out
                log.exception("hub monitor: could not add the span event")
        now = SYSTEM_CLOCK.monotonic()
        if now - self._stack_logged_at.get(location, -STACK_INTERVAL_S) < STACK_INTERVAL_S:
            # Its stack was logged lately: counted in the metric and the summary line only.
            self._summary.tally(location, f"{blocked_ms:.0f} ms by {name}")
            return
        self._stack_logged_at[location] = now
        stack = "".join(block.stack.format()) if block.stack else "  (stack not captured)\n"
        # Logged from a greenlet, not the hub: a log handler may do cooperative I/O.
        spawn_raw(
            log.warning,
            "event loop blocked for %.0f ms (threshold %d ms) by %s%s at %s; "
            "its stack while blocked (the next blocks here in %.0f s are only counted):\n%s",
            blocked_ms,
            self.threshold_ms,
            name,
            f" in span {block.span.name!r}" if block.span is not None else "",
            location,
            STACK_INTERVAL_S,
            stack.rstrip("\n"),
        )


def _greenlet_name(blocked: Any) -> str:
    name = getattr(blocked, "name", None)  # gevent.Greenlet; raw greenlets have none
    return name if isinstance(name, str) else f"{type(blocked).__name__}@{id(blocked):#x}"


def _location(stack: traceback.StackSummary | None) -> str:
    if not stack:
        return "unknown"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"
