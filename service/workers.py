"""Pre-forked workers: one listening socket, ``server.workers`` server processes, a master that keeps them.

Python runs one core per process, so ``server.workers = N`` (N > 1) runs N
single-process servers side by side:

* The master binds and listens once (``server.host``/``server.port``; port 0
  picks one free port that every worker then shares), then forks the workers.
  Each worker is a whole server: :func:`service.lifecycle.run_server` on the
  inherited socket, with its own hub, backend clients and tracing. The kernel
  hands each new connection to whichever worker accepts it first, so an idle
  worker takes more of them than a busy one.
* Nothing that does not survive ``fork`` exists before it: the master starts no
  tracing, no backend clients and no threads. Tracing (whose batch processor
  runs a worker thread) is configured by each worker, after the fork.
* A worker that exits while the master is not stopping is restarted: after
  0.1 s, doubling for each quick death in a row of the same slot, up to 10 s. If
  restarts come too fast (more than ``max(10, 3 * N)`` within 60 s) the master
  gives up: it stops every worker and exits 1, so whatever supervises the master
  sees the failure. A worker that exits 2 (a configuration error, such as an
  unreadable TLS file) stops everything at once with exit status 2.
* SIGTERM or SIGINT: the master closes its copy of the listening socket,
  forwards SIGTERM to every worker, and waits while each drains
  (``server.lame_duck_ms``, ``server.drain_timeout_ms``, ``fanout.abandon_grace_ms`` and
  ``tracing.flush_timeout_ms``, plus a margin); workers still running then are
  killed (SIGKILL). The master exits 0.

Every master decision (start, exit, restart, give-up, kill) is logged with the
worker's pid.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import gevent
import gevent.os
from gevent.queue import Empty, Queue

from service.config import ConfigError, Settings

__all__ = ["run_workers", "bind_listener", "LISTEN_BACKLOG"]

log = logging.getLogger(__name__)

#: Connections the kernel queues for the workers while none of them is accepting.
LISTEN_BACKLOG = 4096
_FIRST_RESTART_DELAY_S = 0.1
_MAX_RESTART_DELAY_S = 10.0
_STABLE_AFTER_S = 10.0           # a worker that lived this long resets its slot's backoff
_STORM_WINDOW_S = 60.0
_STOP_MARGIN_S = 3.0             # beyond the drain, grace and flush budgets, before SIGKILL
_KILL_WAIT_S = 5.0
_CONFIG_ERROR_STATUS = 2         # what ``fanout serve`` exits with for a configuration error
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening; raises OSError if it cannot be.

    ``host`` is used as given (an IPv6 literal if it contains ``:``), so no
    resolver thread starts in the master.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def run_workers(settings: Settings, *,
                on_ready: Optional[Callable[[tuple[str, int], int], None]] = None) -> int:
    """Serve ``settings`` with ``settings.server.workers`` pre-forked worker processes.

    Binds the listening socket (raises OSError if it cannot), forks the workers,
    calls ``on_ready(address, workers)`` once, then supervises until SIGTERM or
    SIGINT. Returns the master's exit code: 0 after a stop, 1 after a restart
    storm, 2 when a worker reported a configuration error.

    Call it from the main greenlet of a process that has started no threads,
    tracing or backend clients: each worker starts its own after the fork.
    """
    return _Master(settings).run(on_ready)


@dataclass
class _Slot:
    """One of the N worker positions; a restarted worker takes its predecessor's slot."""

    index: int
    pid: int = 0
    started_at: float = 0.0
    quick_deaths: int = 0        # deaths in a row, each within _STABLE_AFTER_S of its start
    restart_at: Optional[float] = None


class _Master:
    """The supervising process. Every decision runs in its main greenlet, fork included."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._count = settings.server.workers
        self._slots = [_Slot(index) for index in range(self._count)]
        self._events: Queue = Queue()        # ("exit", pid, wait status) | ("signal", signum)
        self._restarts: deque[float] = deque()
        self._storm_limit = max(10, 3 * self._count)
        self._master_pid = os.getpid()
        self._listener: Optional[socket.socket] = None
        self._signal_handlers: list = []

    # --- life of the master ---------------------------------------------------------------

    def run(self, on_ready: Optional[Callable[[tuple[str, int], int], None]]) -> int:
        server = self._settings.server
        self._listener = bind_listener(server.host, server.port)
        host, port = self._listener.getsockname()[:2]
        # Imported before the fork, so every worker shares these pages instead of loading its own.
        from service.lifecycle import run_server  # noqa: F401
        # Objects alive now are never collected again: the workers' collectors leave
        # their pages untouched, so copy-on-write keeps them shared.
        gc.freeze()
        self._signal_handlers = [gevent.signal_handler(signum, self._events.put, ("signal", signum))
                                 for signum in _STOP_SIGNALS]
        try:
            for slot in self._slots:
                self._fork(slot)
            log.info("master %d: %d workers serving on %s:%d", self._master_pid, self._count,
                     host, port)
            if on_ready is not None:
                on_ready((host, port), self._count)
            return self._supervise()
        except Exception:
            log.exception("master: failed; stopping the workers")
            self._signal_workers(signal.SIGTERM)
            raise
        finally:
            self._cancel_signal_handlers()
            self._listener.close()

    def _supervise(self) -> int:
        while True:
            try:
                event = self._events.get(timeout=self._next_restart_in())
            except Empty:
                event = None
            if event is None:
                self._restart_due()
            elif event[0] == "signal":
                log.info("master: %s received; stopping %d workers",
                         signal.Signals(event[1]).name, len(self._live()))
                return self._stop_all(exit_code=0)
            else:
                verdict = self._on_exit(event[1], event[2])
                if verdict is not None:
                    return self._stop_all(exit_code=verdict)

    # --- workers ----------------------------------------------------------------------------

    def _fork(self, slot: _Slot) -> None:
        try:
            # ref=True: a live worker keeps the master's event loop running.
            pid = gevent.os.fork_and_watch(callback=self._on_child_watcher, ref=True)
        except OSError as exc:  # out of processes or memory: try again later
            slot.restart_at = time.monotonic() + _MAX_RESTART_DELAY_S
            log.error("master: cannot start a worker for slot %d (%s); retrying in %.0f s",
                      slot.index, exc, _MAX_RESTART_DELAY_S)
            return
        if pid == 0:
            self._become_worker(slot)  # never returns
        slot.pid, slot.started_at, slot.restart_at = pid, time.monotonic(), None
        log.info("master: worker %d started (slot %d)", pid, slot.index)

    def _on_child_watcher(self, watcher: object) -> None:
        # Runs in the hub when a worker ends; the main greenlet does the rest.
        self._events.put(("exit", watcher.pid, watcher.rstatus))  # type: ignore[attr-defined]

    def _become_worker(self, slot: _Slot) -> None:
        """The child side of :meth:`_fork`: serve on the inherited socket, then exit."""
        code = 1
        try:
            # The master's handlers were copied by fork; the worker installs its own.
            self._cancel_signal_handlers()
            _end_with_master(self._master_pid)
            from service.lifecycle import run_server

            assert self._listener is not None
            log.info("worker %d: serving (slot %d of %d)", os.getpid(), slot.index, self._count)
            code = run_server(self._settings, listener=self._listener, worker_index=slot.index)
        except Exception as exc:
            log.exception("worker %d failed", os.getpid())
            code = _CONFIG_ERROR_STATUS if isinstance(exc, ConfigError) else 1
        finally:
            logging.shutdown()
            os._exit(code)  # never unwind into the master's code in the child

    def _on_exit(self, pid: int, status: int) -> Optional[int]:
        """Book a worker's exit; schedule its restart. Returns an exit code to stop with, or None."""
        slot = next((s for s in self._slots if s.pid == pid), None)
        if slot is None:
            return None
        slot.pid = 0
        code = os.waitstatus_to_exitcode(status)
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        if code == _CONFIG_ERROR_STATUS:
            log.error("master: worker %d %s (a configuration error); stopping", pid, how)
            return _CONFIG_ERROR_STATUS
        now = time.monotonic()
        slot.quick_deaths = slot.quick_deaths + 1 if now - slot.started_at < _STABLE_AFTER_S else 1
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - _STORM_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > self._storm_limit:
            log.error("master: worker %d %s; %d restarts within %.0f s, giving up", pid, how,
                      len(self._restarts), _STORM_WINDOW_S)
            return 1
        delay = min(_FIRST_RESTART_DELAY_S * 2 ** (slot.quick_deaths - 1), _MAX_RESTART_DELAY_S)
        slot.restart_at = now + delay
        log.warning("master: worker %d %s; restarting slot %d in %.1f s", pid, how, slot.index,
                    delay)
        return None

    def _next_restart_in(self) -> Optional[float]:
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        return None if not due else max(0.0, min(due) - time.monotonic())

    def _restart_due(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if slot.restart_at is not None and slot.restart_at <= now:
                self._fork(slot)

    def _live(self) -> list[int]:
        return [slot.pid for slot in self._slots if slot.pid]

    # --- stopping ---------------------------------------------------------------------------

    def _stop_all(self, exit_code: int) -> int:
        assert self._listener is not None
        # The workers hold their own copies; once they close theirs, connects are refused.
        self._listener.close()
        for slot in self._slots:
            slot.restart_at = None
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
        for slot in self._slots:
            if slot.pid == pid:
                slot.pid = 0
                log.info("master: worker %d stopped (exit code %d)", pid,
                         os.waitstatus_to_exitcode(status))

    def _cancel_signal_handlers(self) -> None:
        for handler in self._signal_handlers:
            handler.cancel()
        self._signal_handlers = []


def _end_with_master(master_pid: int) -> None:
    """Have the kernel send this worker SIGTERM if the master dies (Linux), so none is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: a killed master leaves its workers to be stopped by hand
    if os.getppid() != master_pid:  # the master died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
