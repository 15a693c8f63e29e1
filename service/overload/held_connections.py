"""Held connections: the paced refusals of callers that ignore ``retry_after_ms``, served
from the event loop instead of from a greenlet per caller.

Pacing (:mod:`service.overload.gate`) decides how long a refusal to such a caller
is held; each of its connections is then refused about once per deadline
whatever it does, and the server's CPU goes on the refusals that remain: with a
thousand such callers, about five hundred a second. In a greenlet per
connection each costs two wake-ups of that greenlet, a timer made for the hold
and a wait on the socket, each a switch there and back and gevent's bookkeeping
around it. Done in callbacks of the loop instead, the same work costs about half
the CPU (the manual's Performance page gives the figures), which is why this module exists rather
than a ``gevent.sleep``. And as each turn of the loop has a cost of its own, the
holds end on ticks (``HOLD_TICK_S``): the replies due in one tick go out in one
turn, and the calls their callers send back together are read in one turn too.

So a connection whose answer is to be held leaves its greenlet waiting and is
served here, by callbacks of the hub's loop, until something needs the greenlet:

* the hold ends (on its tick): the reply is written with one non-blocking write;
* the caller's next call arrives while it still counts as early (within
  0.4 x ``retry_after_ms`` of the end of the hold): it is read, and if it is
  refused unread again (:mod:`service.overload.gate`) its refusal is held here too;
* anything else goes back to the greenlet, with whatever was read put back
  into its channel: a call to serve as usual, a partial or oversized frame, the
  end of the stream, an error, a reply the socket would not take whole, the
  caller no longer early, the server draining or the connection too old.

Only plain (not TLS) framed connections with nothing buffered are held here;
the others hold their reply with a sleep in their greenlet (on its tick too). The
callbacks never block and never log: each finished call is recorded
(``rpc.server.call.duration``) by one recorder greenlet, which they wake once a turn.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import gevent
from gevent import GreenletExit
from gevent.hub import Waiter, get_hub

from lookups.clock import SYSTEM_CLOCK, Clock, loop_time
from service.engine.summary import FailureSummary
from tracing.context import spawn_in_context
from tracing.spans import CallDurations

__all__ = ["HeldConnections", "HeldReply", "Unsent", "HOLD_TICK_S", "on_the_tick"]

log = logging.getLogger(__name__)

_FRAME_HEADER = struct.Struct("!i")
_READ_BYTES = 64 * 1024
# Below the default (0) of every other watcher: in each turn of the loop the calls' I/O
# goes first, and the refusals due in that turn after it. A thousand such callers come
# back in waves (held to about the same deadline), and the calls waited behind them.
_PRIORITY = -1
#: Every hold ends on a tick of this many seconds (never later than it was to end). Each
#: turn of the loop costs a wait in epoll, gevent's own callbacks and the switches into
#: and out of the hub; holds ending apart would take a turn each, and their callers, who
#: come back together, would share their reads' turns too. Short beside a hold (most of
#: a deadline) and beside the margin a hold leaves before it (``gate._REPLY_MARGIN_S``).
HOLD_TICK_S = 0.02


class HeldReply(NamedTuple):
    """A reply to write once ``hold_s`` has passed: framed ``payload`` for a call to
    ``method`` read at ``started`` (on the service's clock), answered with ``error_type``."""

    method: str
    error_type: str
    started: float
    payload: bytes
    hold_s: float


class Unsent(NamedTuple):
    """A reply the socket did not take whole: the greenlet sends ``rest`` and records it."""

    reply: HeldReply
    rest: bytes


#: Given a held connection and the body of one whole frame it sent, the reply to hold
#: for it (the call refused unread), or None to serve it in its greenlet.
RefuseNext = Callable[[Any, memoryview], HeldReply | None]


class HeldConnections:
    """The connections held off their greenlets, and the callbacks that serve them.

    ``refuse_next`` decides on a call that arrives while held; ``may_go_on`` says
    whether a connection may serve another call (the server is not draining, the
    connection is not too old). A connection is an object with ``sock``,
    ``channel`` (a :mod:`service.wire.channel` channel) and ``caller`` (its
    :class:`~service.overload.gate.ConnectionPacing`).
    """

    def __init__(
        self,
        refuse_next: RefuseNext,
        may_go_on: Callable[[Any], bool],
        max_frame_bytes: int,
        durations: CallDurations,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock``: the service's, which timed each reply's ``started``."""
        self._clock = clock
        self._refuse_next = refuse_next
        self._durations = durations
        self._may_go_on = may_go_on
        self._max_frame_bytes = max_frame_bytes
        self._holds: set[_Hold] = set()
        self._finished: list[tuple[str, str, float]] = []
        self._recorder: Any | None = None
        self._recorder_waiting: Waiter | None = None
        # A failure per call would be a log line per call: one summary per interval instead.
        self._unrecorded = FailureSummary(log, "held calls not recorded", clock=clock)

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, connection: Any, reply: HeldReply) -> Unsent | None:
        """Hold ``reply``, write it, and serve the connection's early calls, all off this
        greenlet, which waits until the connection is handed back (see the module's list).
        Only for a connection whose channel is ``holdable`` (plain framed, nothing buffered).

        Returns a reply not taken whole, for this greenlet to finish sending, or None.
        Raises the ``OSError`` a read or write on the connection failed with.
        """
        hold = _Hold(self, connection, reply)
        self._holds.add(hold)
        try:
            handed_back = hold.waiter.get()
        except BaseException as exc:  # killed (the drain timed out): the reply goes unwritten
            if hold.reply is not None:
                reply = hold.reply
                self._durations.call_ended(
                    reply.method, type(exc).__name__, self._clock.monotonic() - reply.started
                )
            raise
        finally:
            hold.close()
            self._holds.discard(hold)
        if isinstance(handed_back, OSError):
            raise handed_back
        result: Unsent | None = handed_back
        return result

    def release_all(self) -> None:
        """Write every held reply now and hand every connection back (the server drains)."""
        loop = get_hub().loop
        for hold in list(self._holds):
            loop.run_callback(self._release, hold)

    def _ended(self, reply: HeldReply, error_type: str) -> None:
        """Record a held call as finished (from a callback of the hub): by the recorder
        greenlet, since recording takes locks that a callback must not wait on."""
        self._finished.append((reply.method, error_type, self._clock.monotonic() - reply.started))
        if self._recorder is None:
            # Once: a greenlet spawned per call costs a stack mapped and unmapped (8 us).
            self._recorder = spawn_in_context(self._record_finished)
        elif self._recorder_waiting is not None:
            # Woken after this turn of the loop, not now: the replies due in the same turn
            # are then recorded together, with one switch to the recorder, not one each.
            waiter, self._recorder_waiting = self._recorder_waiting, None
            get_hub().loop.run_callback(waiter.switch, None)

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
                except Exception as exc:  # noqa: BLE001 - a metrics bug must not stop the recording
                    self._unrecorded.count(type(exc).__name__, error=exc)

    # --- callbacks of the hub's loop: none blocks --------------------------------------

    def _due(self, hold: _Hold) -> None:
        """The hold is over: write the reply, then wait for the caller's next call."""
        reply, hold.reply = hold.reply, None
        assert reply is not None
        try:
            sent = os.write(hold.fd, reply.payload)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._ended(reply, type(exc).__name__)
            hold.hand_back(exc)
            return
        if sent < len(reply.payload):
            hold.hand_back(Unsent(reply, reply.payload[sent:]))
            return
        self._ended(reply, reply.error_type)
        early_s = hold.connection.caller.early_for_s()
        if early_s <= 0 or not self._may_go_on(hold.connection):
            hold.hand_back(None)
            return
        hold.connection.channel.idle = True
        hold.arm(early_s, self._no_longer_early)
        hold.io.start(self._readable, hold)

    def _no_longer_early(self, hold: _Hold) -> None:
        hold.hand_back(None)

    def _readable(self, hold: _Hold) -> None:
        """The caller sent something: refuse it here again, or hand it to the greenlet."""
        try:
            data = os.read(hold.fd, _READ_BYTES)
        except BlockingIOError:
            return  # nothing after all; the watcher stays on
        except OSError as exc:
            hold.hand_back(exc)
            return
        hold.io.stop()
        hold.connection.channel.idle = False
        try:
            reply = self._refusal(hold.connection, data) if data else None
        except Exception:  # noqa: BLE001 - a bug must not strand the connection: its greenlet decides again,
            reply = None  # and logs the failure there (no logging in a callback of the hub)
        if reply is None:
            if data:  # a call for the greenlet (or the end of the stream, which it sees too)
                hold.connection.channel.push_back(data)
            hold.hand_back(None)
            return
        hold.hold_reply(reply, self._due)

    def _refusal(self, connection: Any, data: bytes) -> HeldReply | None:
        """The held reply for ``data`` if it is exactly one whole frame refused unread."""
        if len(data) < _FRAME_HEADER.size:
            return None
        (length,) = _FRAME_HEADER.unpack_from(data)
        if not 0 <= length <= self._max_frame_bytes or len(data) != _FRAME_HEADER.size + length:
            return None  # partial, pipelined or over the limit: the greenlet's channel decides
        return self._refuse_next(connection, memoryview(data)[_FRAME_HEADER.size :])

    def _release(self, hold: _Hold) -> None:
        if hold.reply is not None and not hold.handed_back:
            self._due(hold)  # answered now; draining, so it is then handed back
        if not hold.handed_back:
            hold.hand_back(None)


def on_the_tick(loop: Any, seconds: float) -> float:
    """``seconds`` from now (the time of ``loop``'s turn) shortened to end on a tick of
    ``HOLD_TICK_S``: the holds that end in the same tick end in the same turn."""
    now = loop_time(loop)
    on_tick = (now + seconds) // HOLD_TICK_S * HOLD_TICK_S - now
    result: float = max(0.0, min(seconds, on_tick))  # min: the product may round a hair up
    return result


class _Hold:
    """One held connection: its greenlet's waiter, its watchers and the reply held."""

    __slots__ = ("connection", "fd", "waiter", "io", "timer", "reply", "handed_back")

    def __init__(self, held: HeldConnections, connection: Any, reply: HeldReply) -> None:
        loop = get_hub().loop
        self.connection = connection
        self.fd = connection.sock.fileno()
        self.waiter = Waiter()
        self.io = loop.io(self.fd, 1, priority=_PRIORITY)
        self.timer: Any = None
        self.reply: HeldReply | None = None
        self.handed_back = False
        connection.channel.idle = False
        self.hold_reply(reply, held._due)

    def hold_reply(self, reply: HeldReply, due: Callable[[_Hold], None]) -> None:
        """Hold ``reply`` until the tick its hold ends on; then ``due`` writes it."""
        self.reply = reply
        self.arm(on_the_tick(self.io.loop, reply.hold_s), due)

    def arm(self, seconds: float, callback: Callable[[_Hold], None]) -> None:
        if self.timer is not None:
            self.timer.close()
        self.timer = self.io.loop.timer(seconds, priority=_PRIORITY)
        self.timer.start(callback, self)

    def hand_back(self, value: Any) -> None:
        """Stop serving the connection here and wake its greenlet with ``value``."""
        self.io.stop()
        self.timer.stop()
        self.handed_back = True
        self.waiter.switch(value)

    def close(self) -> None:
        self.io.close()
        if self.timer is not None:
            self.timer.close()
