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
* A native thread wakes every quarter threshold (at least 5 ms) while the loop
  runs greenlets; while it sits idle in the hub, nothing can block, and the thread
  looks half as often at each idle look, down to once per
  :data:`IDLE_PERIOD_THRESHOLDS` thresholds; a look that finds it idle again after a
  brief run (a timer, a health check) keeps that pace. Each wake-up of a thread costs,
  and an idle server's monitor was a large part of what the server cost at rest
  (``make bench-idle`` measures it on and off): at the default threshold it now looks
  once a second at rest, where it looked five times. When
  the hub has not run for longer than the threshold, it takes the blocked thread's stack
  and the blocked greenlet's current span, and hands them to the hub with
  ``loop.run_callback_threadsafe``; the report runs there, in the monitored
  thread, as soon as the loop runs again. Nothing is logged or recorded from
  the monitor thread itself.
* Another thread cannot read the context of a running greenlet, so the current
  span per greenlet comes from a span processor on the global SDK tracer
  provider (:class:`_GreenletSpans`): a dict update per span start and end,
  only for recorded spans. Without an SDK provider there are no span events.

A run between one threshold and one and a quarter thresholds long may end
before the monitor looks and go unreported; longer ones are always reported, except
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
One monitor per thread: a second :meth:`HubMonitor.start` in the same thread
is a no-op (logged).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
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

__all__ = ["HubMonitor", "BLOCKED_EVENT"]

log = logging.getLogger(__name__)

#: Name of the span event added for a blocked run.
BLOCKED_EVENT = "hub.blocked"
#: A place's stack is logged at most once in this long; its later blocks are counted.
STACK_INTERVAL_S = 600.0
#: The blocks counted, not logged, are summed up in one line at most this often.
SUMMARY_INTERVAL_S = 60.0

_STACK_FRAMES = 8  # innermost frames of the blocked stack kept in the report
_MIN_PERIOD_S = 0.005  # the monitor thread never wakes more often than this
#: While the loop stays idle, the monitor looks once per this many thresholds at most.
IDLE_PERIOD_THRESHOLDS = 10
_MAX_OPEN_SPANS = 100_000  # a bound on the span registry, against spans never ended

_start_thread = get_original("_thread", "start_new_thread")
_thread_sleep = get_original("time", "sleep")
_get_ident = get_original("_thread", "get_ident")


class _GreenletSpans(SpanProcessor):
    """The innermost open span of each greenlet, readable from another thread.

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
        """The innermost open span started by greenlet ``owner``; safe from any thread."""
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
_active: dict[tuple[int, int], HubMonitor] = {}  # (pid, thread ident) -> the monitor running there


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


class _Look(enum.Enum):
    """What the monitor thread found the loop doing since its last look."""

    IDLE = "idle"  # in the hub, and nothing ran since the last look
    RESTING = "resting"  # in the hub, after running something since
    BUSY = "busy"  # running a greenlet (blocked, perhaps)


@dataclass
class _Watch:
    """The state of one :meth:`HubMonitor.start`, shared with its monitor thread."""

    tracer: Any
    hub: Any
    thread_ident: int
    key: tuple[int, int]  # its key in _active
    threshold_s: float
    period_s: float
    running: bool = True
    uses_spans: bool = False  # counted in _SPANS.users
    reported_entry: float = 0.0  # hub entry time of the last run reported
    seen_entry: float = 0.0  # hub entry time at the monitor's last look
    waiting_s: float = 0.0  # what the monitor thread waits between looks now


@dataclass(frozen=True)
class _Block:
    """One blocked run, as seen by the monitor thread."""

    greenlet: Any
    entered_hub: float  # SYSTEM_CLOCK.monotonic() when the hub last ran before the block
    stack: traceback.StackSummary | None
    span: Span | None


class HubMonitor:
    """Reports event-loop blocks longer than ``threshold_ms``; ``threshold_ms`` 0 disables it.

    Call :meth:`start` and :meth:`stop` in the thread whose event loop to watch.
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
        """Install the switch tracer and start the monitor thread; a no-op when disabled,
        already running, or when another monitor runs in this thread."""
        if self.threshold_ms == 0 or self._watch is not None:
            return self
        ident = _get_ident()
        key = (os.getpid(), ident)  # a forked child may reuse the parent's thread ident
        if key in _active:
            log.info("hub monitor: one is already running in this thread; not starting another")
            return self
        hub = get_hub()
        threshold_s = self.threshold_ms / 1000.0
        watch = _Watch(
            HubSwitchTracer(hub, threshold_s),
            hub,
            ident,
            key,
            threshold_s,
            max(threshold_s / 4, _MIN_PERIOD_S),
        )
        if _attach_span_registry():
            watch.uses_spans = True
            _SPANS.users += 1
        self._watch, _active[key] = watch, self
        _start_thread(self._monitor, (watch,))
        log.info("hub monitor: reporting event-loop blocks over %d ms", self.threshold_ms)
        return self

    @property
    def waiting_s(self) -> float:
        """What the monitor thread waits between looks now: its period while the loop is
        busy, up to :data:`IDLE_PERIOD_THRESHOLDS` thresholds while it is idle (0 before
        :meth:`start`)."""
        return self._watch.waiting_s if self._watch is not None else 0.0

    def flush(self) -> None:
        """Log the summary of the blocks counted since the last one (at shutdown)."""
        self._summary.flush()

    def stop(self) -> None:
        """Stop reporting and remove the tracer; idempotent. The thread ends within one period."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        self._summary.flush()
        watch.running = False
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

    def _monitor(self, watch: _Watch) -> None:
        """The monitor thread. Reads the tracer; writes nothing the hub acts on (only
        ``watch.waiting_s``, which :attr:`waiting_s` reports)."""
        watch.waiting_s = watch.period_s
        try:
            while watch.running:
                _thread_sleep(watch.waiting_s)
                if watch.running:
                    looked = self._check(watch)
                    # An idle loop cannot block: look less often, up to once an idle period.
                    # A loop that ran something and is idle again (a timer, a health check)
                    # keeps the pace it had; one found running greenlets is looked at often.
                    if looked is _Look.BUSY:
                        watch.waiting_s = watch.period_s
                    elif looked is _Look.IDLE:
                        watch.waiting_s = min(
                            watch.waiting_s * 2, watch.threshold_s * IDLE_PERIOD_THRESHOLDS
                        )
        except Exception as exc:  # noqa: BLE001 - the process is exiting, or a bug: report it in the hub
            if watch.running:
                watch.hub.loop.run_callback_threadsafe(
                    log.error, "hub monitor: monitor thread failed: %r", exc
                )

    def _check(self, watch: _Watch) -> _Look:
        """Report a block going on; what the loop did since the last look."""
        tracer = watch.tracer
        entered = tracer.last_entered_hub
        blocked = tracer.active_greenlet
        seen, watch.seen_entry = watch.seen_entry, entered
        if blocked is watch.hub:
            return _Look.IDLE if entered == seen else _Look.RESTING
        if blocked is None or not entered or entered == watch.reported_entry:
            return _Look.BUSY
        if SYSTEM_CLOCK.monotonic() - entered < watch.threshold_s:
            return _Look.BUSY
        watch.reported_entry = entered
        frame = sys._current_frames().get(watch.thread_ident)
        stack = traceback.extract_stack(frame, limit=_STACK_FRAMES) if frame is not None else None
        if tracer.last_entered_hub != entered:
            stack = None  # the block ended while we looked: that stack is someone else's
        block = _Block(blocked, entered, stack, _SPANS.innermost(blocked))
        watch.hub.loop.run_callback_threadsafe(self._report, watch, block)
        return _Look.BUSY

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
