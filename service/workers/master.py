"""The pre-fork master: one listening socket, ``server.workers`` server processes.

* The master binds once and forks; each worker is a whole server
  (:func:`service.lifecycle.run_server` on the inherited socket). Nothing that
  does not survive ``fork`` exists before it: no tracing, clients or threads.
* A worker that exits is restarted after 0.1 s, doubling per quick death of its
  slot up to 10 s; more than ``max(10, 3 * N)`` restarts within 60 s stop
  everything (exit 1); a worker exiting 2 (a configuration error) stops
  everything with status 2.
* A worker whose event loop stops beating (``heartbeat.py``) for
  ``server.worker_heartbeat_timeout_ms`` is killed, then restarted.
* SIGHUP reloads the configuration (as at start) and replaces every worker,
  the old ones draining; SIGTTIN / SIGTTOU add / retire one worker.
  ``server.host`` and ``server.port`` cannot change on a reload.
* The master serves the group's one probe endpoint and one Prometheus scrape
  (``group.py``); workers serve neither on those ports.
* SIGTERM or SIGINT: forwarded to every worker, which drains; those still
  running after the lame-duck, drain, grace and flush budgets plus a margin are
  killed. The master exits 0.

Every decision (start, exit, restart, kill, reload) is logged with the pid.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import time
from typing import Callable, Optional

import gevent
import gevent.os
from gevent.queue import Empty, Queue

from service.config import ConfigError, Settings
from service.logs import set_worker
from service.workers.group import GroupEndpoints
from service.ports import bind_listener
from service.workers.heartbeat import Heartbeats
from service.workers.process import signal_name
from service.workers.slots import MAX_RESTART_DELAY_S, STORM_WINDOW_S, Slot, Slots
from service.workers.worker import CONFIG_ERROR_STATUS, WorkerStart, serve_as_worker
from tracing.metrics import scrape_address

__all__ = ["run_workers"]

log = logging.getLogger(__name__)

_STOP_MARGIN_S = 3.0             # beyond the drain, grace and flush budgets, before SIGKILL
_KILL_WAIT_S = 5.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RESIZE_SIGNALS = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


def run_workers(settings: Settings, *, reload: Optional[Callable[[], Settings]] = None,
                on_ready: Optional[Callable[[tuple[str, int], int], None]] = None) -> int:
    """Serve ``settings`` with ``settings.server.workers`` pre-forked worker processes.

    Binds the listening socket (raises OSError if it cannot), forks the workers,
    calls ``on_ready(address, workers)`` once, then supervises until SIGTERM or
    SIGINT. Returns the master's exit code: 0 after a stop, 1 after a restart
    storm, 2 when a worker reported a configuration error.

    Call it from the main greenlet of a process that has started no threads,
    tracing or backend clients: each worker starts its own after the fork.
    """
    return _Master(settings, reload).run(on_ready)


class _Master:
    """The supervising process. Every decision runs in its main greenlet, fork included."""

    def __init__(self, settings: Settings, reload: Optional[Callable[[], Settings]] = None) -> None:
        self._settings = settings
        self._reload = reload
        self._heartbeats = Heartbeats()
        self._retiring: set[int] = set()     # old workers draining after a reload or a TTOU
        self._slots = Slots(settings.server.workers)
        self._events: Queue = Queue()        # ("exit", pid, wait status) | ("signal", signum)
        self._master_pid = os.getpid()
        self._listener: Optional[socket.socket] = None
        self._group: Optional[GroupEndpoints] = None
        self._stopping = False
        self._signal_handlers: list = []

    def run(self, on_ready: Optional[Callable[[tuple[str, int], int], None]]) -> int:
        server = self._settings.server
        set_worker("master")
        self._listener = bind_listener(server.host, server.port)
        host, port = self._listener.getsockname()[:2]
        try:
            self._group = GroupEndpoints(server.probe_bind_host, server.probe_port,
                                         scrape_address(self._settings.metrics),
                                         lambda: self._slots.states(self._heartbeats),
                                         lambda: self._stopping).start()
        except OSError:
            self._listener.close()
            raise
        # Imported before the fork, so every worker shares these pages instead of loading its own.
        from service.lifecycle import run_server  # noqa: F401
        # Objects alive now are never collected again: the workers' collectors leave
        # their pages untouched, so copy-on-write keeps them shared.
        gc.freeze()
        self._signal_handlers = [gevent.signal_handler(signum, self._events.put, ("signal", signum))
                                 for signum in (*_STOP_SIGNALS, *_RESIZE_SIGNALS)]
        try:
            for slot in self._slots:
                self._fork(slot)
            log.info("master %d: %d workers serving on %s:%d", self._master_pid,
                     len(self._slots), host, port)
            if on_ready is not None:
                on_ready((host, port), len(self._slots))
            return self._supervise()
        except Exception:
            log.exception("master: failed; stopping the workers")
            self._signal_workers(signal.SIGTERM)
            raise
        finally:
            self._cancel_signal_handlers()
            self._listener.close()
            self._group.stop()
            self._heartbeats.remove()

    def _supervise(self) -> int:
        while True:
            try:
                event = self._events.get(timeout=self._slots.next_wake_in())
            except Empty:
                event = None
            if event is None:
                for slot in self._slots.due():
                    self._fork(slot)
                self._kill_stuck()
            elif event[0] == "signal" and event[1] in _RESIZE_SIGNALS:
                self._resize(event[1])
            elif event[0] == "signal":
                log.info("master: %s received; stopping %d workers",
                         signal.Signals(event[1]).name, len(self._live()))
                self._stopping = True
                return self._stop_all(exit_code=0)
            else:
                verdict = self._on_exit(event[1], event[2])
                if verdict is not None:
                    return self._stop_all(exit_code=verdict)

    def _fork(self, slot: Slot) -> None:
        try:
            # ref=True: a live worker keeps the master's event loop running.
            pid = gevent.os.fork_and_watch(callback=self._on_child_watcher, ref=True)
        except OSError as exc:  # out of processes or memory: try again later
            self._slots.fork_failed(slot)
            log.error("master: cannot start a worker for slot %d (%s); retrying in %.0f s",
                      slot.index, exc, MAX_RESTART_DELAY_S)
            return
        if pid == 0:
            self._become_worker(slot)  # never returns
        self._heartbeats.reset(slot.index)
        self._slots.started(slot, pid)
        log.info("master: worker %d started (slot %d)", pid, slot.index)

    def _on_child_watcher(self, watcher: object) -> None:
        # Runs in the hub when a worker ends; the main greenlet does the rest.
        self._events.put(("exit", watcher.pid, watcher.rstatus))  # type: ignore[attr-defined]

    def _become_worker(self, slot: Slot) -> None:
        """The child side of :meth:`_fork`: drop the master's handlers and ports, serve, exit."""
        # The master's handlers were copied by fork; the worker installs its own.
        self._cancel_signal_handlers()
        assert self._listener is not None and self._group is not None
        self._group.close_in_worker()
        serve_as_worker(WorkerStart(self._settings, slot.index, len(self._slots),
                                    self._master_pid, self._listener, self._heartbeats))

    def _on_exit(self, pid: int, status: int) -> Optional[int]:
        """Book a worker's exit; schedule its restart. Returns an exit code to stop with, or None."""
        if pid in self._retiring:
            self._retiring.discard(pid)
            log.info("master: retired worker %d stopped (exit code %d)", pid,
                     os.waitstatus_to_exitcode(status))
            return None
        slot = self._slots.holding(pid)
        if slot is None:
            return None
        code = os.waitstatus_to_exitcode(status)
        how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
        if code == CONFIG_ERROR_STATUS:
            slot.pid = 0
            log.error("master: worker %d %s (a configuration error); stopping", pid, how)
            return CONFIG_ERROR_STATUS
        delay = self._slots.died(slot)
        if delay is None:
            log.error("master: worker %d %s; %d restarts within %.0f s, giving up", pid, how,
                      self._slots.recent_restarts, STORM_WINDOW_S)
            return 1
        log.warning("master: worker %d %s; restarting slot %d in %.1f s", pid, how, slot.index,
                    delay)
        return None

    def _kill_stuck(self) -> None:
        """SIGKILL a worker whose heartbeat is older than ``server.worker_heartbeat_timeout_ms``."""
        for slot in self._slots.stuck(self._heartbeats,
                                      self._settings.server.worker_heartbeat_timeout_ms):
            log.warning("master: worker %d (slot %d) missed its heartbeat for %.1f s; killing it",
                        slot.pid, slot.index, self._heartbeats.age_s(slot.index))
            try:
                os.kill(slot.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._heartbeats.reset(slot.index)  # one kill per stale beat; its exit restarts it

    def _live(self) -> list[int]:
        return self._slots.pids() + sorted(self._retiring)

    def _resize(self, signum: int) -> None:
        """SIGHUP: reload the settings and replace every worker (the old ones drain);
        SIGTTIN / SIGTTOU: one worker more / one fewer (never fewer than one)."""
        if signum == signal.SIGTTIN:
            self._fork(self._slots.add())
        elif signum == signal.SIGTTOU and len(self._slots) > 1:
            self._retire([self._slots.remove_last().pid])
        elif signum == signal.SIGHUP and (settings := self._reloaded()) is not None:
            self._settings = settings
            old = self._slots.replace(settings.server.workers)
            for slot in self._slots:
                self._fork(slot)
            self._retire([slot.pid for slot in old])
        log.info("master: %s: %d workers", signal.Signals(signum).name, len(self._slots))

    def _reloaded(self) -> Optional[Settings]:
        if self._reload is None:
            log.warning("master: SIGHUP received, but there is no configuration to reload")
            return None
        try:
            settings = self._reload()
        except ConfigError as exc:
            log.error("master: SIGHUP: the new configuration is refused, keeping the old: %s", exc)
            return None
        old = self._settings
        if _ports(settings) != _ports(old):
            log.warning("master: SIGHUP: the listening address, the probes' and [metrics] "
                        "cannot change on a reload; the group keeps its ports")
        return settings

    def _retire(self, pids: list[int]) -> None:
        for pid in filter(None, pids):
            self._retiring.add(pid)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _stop_all(self, exit_code: int) -> int:
        assert self._listener is not None
        # The workers hold their own copies; once they close theirs, connects are refused.
        self._listener.close()
        self._slots.cancel_restarts()
        self._signal_workers(signal.SIGTERM)
        if not self._wait_for_workers(self._drain_budget_s()):
            live = self._live()
            log.warning("master: %d worker(s) still running after %.1f s; killing %s", len(live),
                        self._drain_budget_s(), live)
            self._signal_workers(signal.SIGKILL)
            self._wait_for_workers(_KILL_WAIT_S)
        log.info("master: all workers stopped; exiting %d", exit_code)
        return exit_code

    def _drain_budget_s(self) -> float:
        s = self._settings
        return (s.server.lame_duck_ms + s.server.drain_timeout_ms + s.fanout.abandon_grace_ms
                + s.tracing.flush_timeout_ms) / 1000.0 + _STOP_MARGIN_S

    def _signal_workers(self, signum: int) -> None:
        for pid in self._live():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # already gone; its exit event is on the way

    def _wait_for_workers(self, timeout_s: float) -> bool:
        """Book worker exits until none is left or ``timeout_s`` passes; True if none is left."""
        deadline = time.monotonic() + timeout_s
        while self._live():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                event = self._events.get(timeout=remaining)
            except Empty:
                return False
            if event[0] == "exit":
                self._book_stopped(event[1], event[2])
            else:
                log.info("master: %s received while stopping; still waiting for the workers",
                         signal.Signals(event[1]).name)
        return True

    def _book_stopped(self, pid: int, status: int) -> None:
        self._retiring.discard(pid)
        slot = self._slots.holding(pid)
        if slot is not None:
            slot.pid = 0
            log.info("master: worker %d stopped (exit code %d)", pid,
                     os.waitstatus_to_exitcode(status))

    def _cancel_signal_handlers(self) -> None:
        for handler in self._signal_handlers:
            handler.cancel()
        self._signal_handlers = []


def _ports(settings: Settings) -> tuple[object, ...]:
    """What a reload cannot change: the group binds these once."""
    server = settings.server
    return server.host, server.port, server.probe_bind_host, server.probe_port, settings.metrics
