"""The pre-fork master: one listening socket, ``server.workers`` server processes.

* The master binds once and starts each worker as a program of its own
  (:mod:`service.workers.launch`), handing it the listener over its control
  line; each worker is a whole server (:func:`service.workers.lifecycle.run_server`).
* A worker that exits is restarted with a backoff (``positions.py``); a restart storm
  stops everything (exit 1), and so does a configuration error (exit 2).
* A worker whose event loop stops beating (``heartbeat.py``) for
  ``server.worker_heartbeat_timeout_ms`` is killed, with one log line, then restarted.
* SIGHUP reloads the configuration (as at start) and starts a new generation of
  workers; once they serve, each old worker hands its connections over
  (:mod:`service.listener.handover`) and exits. SIGTTIN / SIGTTOU add / retire one worker.
  ``server.host`` and ``server.port`` cannot change on a reload.
* Connections spread again when one worker holds too many (``balance.py``), as
  after a worker was replaced: the fullest hand idle ones over, through the master.
* The master serves the group's one probe endpoint and one Prometheus scrape
  (``group.py``), checks the backends for the whole group, and tells every worker
  the result and every worker's pools (``group_state.py``).
* SIGTERM or SIGINT: every worker drains (``stopping.py``); the master exits 0. Every
  decision (start, exit, restart, kill, reload, moves) is logged with the pid.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import zlib
from collections.abc import Callable
from typing import Any

import gevent
from gevent.queue import Empty, Queue

from lookups.clock import SYSTEM_CLOCK, Clock
from service.operations.logs import set_worker
from service.operations.ports import bind_listener
from service.settings.config import ConfigError, Settings
from service.workers.counts import GroupCounts
from service.workers.group import GroupEndpoints, ScrapeTarget
from service.workers.group_state import GroupState
from service.workers.heartbeat import Heartbeats, looks_stuck, process_state
from service.workers.launch import WorkerLink, launch_worker
from service.workers.positions import MAX_RESTART_DELAY_S, STORM_WINDOW_S, Position, Positions
from service.workers.process import CONFIG_ERROR_STATUS, signal_name
from service.workers.stopping import drain_time_s, send_signal, stop_workers
from tracing.call_tally import read_call_tally
from tracing.metrics import scrape_address

__all__ = ["run_workers"]

log = logging.getLogger(__name__)

_TICK_S = 0.5  # restarts due, stuck workers, retirements, the group's state
_NEW_GENERATION_WAIT_S = 60.0  # longest the old workers serve on while the new ones start
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RESIZE_SIGNALS = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


def run_workers(
    settings: Settings,
    *,
    reload: Callable[[], Settings] | None = None,
    on_ready: Callable[[tuple[str, int], int], None] | None = None,
) -> int:
    """Serve ``settings`` with ``settings.server.workers`` worker processes.

    Binds the listening socket (raises OSError if it cannot), starts the workers, calls
    ``on_ready(address, workers)`` once every worker serves, and supervises until SIGTERM
    or SIGINT. Returns 0 after a stop, 1 after a restart storm, 2 on a configuration error.
    """
    return _Master(settings, reload).run(on_ready)


class _Master:
    """The supervising process. Every decision runs in its main greenlet."""

    def __init__(
        self,
        settings: Settings,
        reload: Callable[[], Settings] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._reload = reload
        self._heartbeats = Heartbeats(clock=clock)
        self._cpu_at_beat: dict[int, float] = {}  # by worker pid: its CPU at a fresh beat seen
        self._positions = Positions(settings.server.workers, clock)
        self._ledger = GroupCounts()  # every worker's counts, across lifetimes
        self._links: dict[int, WorkerLink] = {}  # by pid: every worker running, old ones too
        self._old_generation: list[WorkerLink] = []  # to retire once the new one serves
        self._old_since = 0.0
        self._serial = 0
        self._events: Queue = Queue()  # ("exit", pid, code) | ("signal", signum) | ("control", ...)
        self._master_pid = os.getpid()
        self._listener: socket.socket | None = None
        self._group: GroupEndpoints | None = None
        self._state: GroupState | None = None
        self._stopping = False
        self._signal_handlers: list[Any] = []
        self._on_ready: Callable[[], None] | None = None  # once every worker first serves

    def run(self, on_ready: Callable[[tuple[str, int], int], None] | None) -> int:
        server = self._settings.server
        set_worker("master")
        self._listener = listener = bind_listener(server.host, server.port)
        host, port = listener.getsockname()[:2]
        self._state = GroupState(self._settings, self._links, self._serving, self._clock)
        try:
            self._group = GroupEndpoints(
                server.probe_bind_host,
                server.probe_port,
                scrape_address(self._settings.metrics),
                lambda: self._positions.states(self._heartbeats),
                lambda: self._stopping,
                self._state,
                self._scrape_targets,
                self._ledger,
                lambda: bool(self._old_generation),
                lambda: (len(self._positions), self._positions.exits),
            ).start()
        except OSError:
            listener.close()
            self._state.close()
            raise
        self._signal_handlers = [
            gevent.signal_handler(signum, self._events.put, ("signal", signum))
            for signum in (*_STOP_SIGNALS, *_RESIZE_SIGNALS)
        ]
        try:
            for position in self._positions:
                self._start(position)
            self._on_ready = lambda: (
                on_ready((host, port), len(self._positions)) if on_ready else None
            )
            return self._supervise()
        except Exception:
            log.exception("master: failed; stopping the workers")
            for pid in list(self._links):
                send_signal(pid, signal.SIGTERM)
            raise
        finally:
            self._cancel_signal_handlers()
            listener.close()
            self._group.stop()
            self._state.close()
            self._heartbeats.remove()

    def _supervise(self) -> int:
        ticked = self._clock.monotonic()
        while True:
            try:
                event = self._events.get(timeout=self._positions.next_wake_in())
            except Empty:
                event = None
            if self._clock.monotonic() - ticked >= _TICK_S or event is None:
                ticked = self._clock.monotonic()
                self._tick()
            if event is None:
                continue
            if event[0] == "control":
                self._on_control(*event[1:])
            elif event[0] == "signal" and event[1] in _RESIZE_SIGNALS:
                self._resize(event[1])
            elif event[0] == "signal":
                log.info(
                    "master: %s received; stopping %d workers",
                    signal.Signals(event[1]).name,
                    len(self._links),
                )
                self._stopping = True
                return self._stop_all(exit_code=0)
            else:
                verdict = self._on_exit(event[1], event[2])
                if verdict is not None:
                    return self._stop_all(exit_code=verdict)

    def _tick(self) -> None:
        for position in self._positions.due():
            self._start(position)
        self._kill_stuck()
        self._retire_old_generation()
        assert self._state is not None
        self._state.tick()
        if self._on_ready is not None and len(self._serving()) == len(self._positions):
            on_ready, self._on_ready = self._on_ready, None
            log.info("master %d: %d workers serving", self._master_pid, len(self._positions))
            on_ready()

    def _serving(self) -> list[WorkerLink]:
        """The current generation's workers that serve and beat: where connections may go."""
        states = {index: state for index, state, _ in self._positions.states(self._heartbeats)}
        return [
            link
            for position in self._positions
            if (link := self._links.get(position.pid))
            and states.get(position.index) == "serving"
            and not link.retiring
        ]

    def _scrape_targets(self) -> list[ScrapeTarget]:
        """Every running worker that serves its metrics, old generation and retiring ones too."""
        targets = []
        for link in self._links.values():
            announced = self._heartbeats.announced_by(link.serial, link.pid)
            if announced and announced.get("metrics"):
                targets.append(
                    ScrapeTarget(link.position, link.pid, link.serial, announced["metrics"])
                )
        return targets

    def _start(self, position: Position) -> None:
        assert self._listener is not None
        self._serial += 1
        self._heartbeats.reset(self._serial)
        try:
            link = launch_worker(
                self._settings,
                position.index,
                self._serial,
                len(self._positions),
                listener=self._listener,
                heartbeats=self._heartbeats.directory,
                events=self._events,
            )
        except OSError as exc:  # out of processes or memory: try again later
            self._positions.fork_failed(position)
            log.error(
                "master: cannot start a worker for position %d (%s); retrying in %.0f s",
                position.index,
                exc,
                MAX_RESTART_DELAY_S,
            )
            return
        self._links[link.pid] = link
        self._positions.started(position, link.pid, self._serial)
        log.info("master: worker %d started (position %d)", link.pid, position.index)

    def _on_control(self, pid: int, message: dict[str, Any], fd: int | None) -> None:
        assert self._state is not None
        link = self._links.get(pid)
        if link is not None and message.get("kind") == "counts":
            exposition = zlib.decompress(message["exposition"]).decode()
            self._ledger.final(link.serial, str(link.position), exposition)
        elif link is not None:
            self._state.on_message(link, message, fd)
        elif fd is not None:
            os.close(fd)

    def _on_exit(self, pid: int, code: int) -> int | None:
        """Book a worker's exit; schedule its restart. Returns an exit code to stop with, or
        None."""
        link = self._links.pop(pid, None)
        position = self._positions.holding(pid)
        if link is not None:
            calls = read_call_tally(self._heartbeats.calls_path(link.serial))
            self._ledger.exited(link.serial, str(link.position), calls)
            self._heartbeats.forget(link.serial)
        if link is not None and link.retiring:
            log.info("master: retired worker %d stopped (exit code %d)", pid, code)
            return None
        if position is None:
            return None
        how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
        if code == CONFIG_ERROR_STATUS:
            position.pid = 0
            log.error("master: worker %d %s (a configuration error); stopping", pid, how)
            return CONFIG_ERROR_STATUS
        delay = self._positions.died(position)
        if delay is None:
            log.error(
                "master: worker %d %s; %d restarts within %.0f s, giving up",
                pid,
                how,
                self._positions.recent_restarts,
                STORM_WINDOW_S,
            )
            return 1
        log.warning(
            "master: worker %d %s; restarting position %d in %.1f s",
            pid,
            how,
            position.index,
            delay,
        )
        return None

    def _kill_stuck(self) -> None:
        """SIGKILL a worker whose heartbeat is older than ``server.worker_heartbeat_timeout_ms``
        and that looks stuck, not starved of a core (:func:`looks_stuck`)."""
        timeout_ms = self._settings.server.worker_heartbeat_timeout_ms
        if not timeout_ms:
            return  # 0: workers are never killed for their heartbeat
        self._note_fresh_beats(timeout_ms / 2000.0)
        for position in self._positions.stuck(self._heartbeats, timeout_ms):
            state = process_state(position.pid)
            cpu_since = state.cpu_s - self._cpu_at_beat.get(position.pid, 0.0) if state else 0.0
            if not looks_stuck(state, cpu_since, timeout_ms / 1000.0):
                continue  # runnable, waiting for a core: it beats once it has one
            log.warning(
                "master: worker %d (position %d) has not answered for %.1f s (stopped or "
                "blocked); killing it",
                position.pid,
                position.index,
                self._heartbeats.age_s(position.serial),
            )
            try:
                os.kill(position.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._heartbeats.reset(position.serial)  # one kill per stale beat; its exit restarts it

    def _note_fresh_beats(self, fresh_s: float) -> None:
        """Each worker's CPU when its beat was last seen fresh (younger than ``fresh_s``)."""
        alive = set()
        for position in self._positions:
            if not position.pid:
                continue
            alive.add(position.pid)
            if self._heartbeats.age_s(position.serial) < fresh_s:
                state = process_state(position.pid)
                if state is not None:
                    self._cpu_at_beat[position.pid] = state.cpu_s
        for pid in set(self._cpu_at_beat) - alive:
            del self._cpu_at_beat[pid]

    def _resize(self, signum: int) -> None:
        """SIGHUP: reload the settings and replace every worker (the old ones hand their
        connections over once the new ones serve); SIGTTIN / SIGTTOU: one worker more /
        one fewer (never fewer than one)."""
        if signum == signal.SIGTTIN:
            self._start(self._positions.add())
        elif signum == signal.SIGTTOU and len(self._positions) > 1:
            self._retire([self._positions.remove_last().pid])
        elif signum == signal.SIGHUP and (settings := self._reloaded()) is not None:
            self._settings = settings
            old = self._positions.replace(settings.server.workers)
            self._old_generation += [self._links[p.pid] for p in old if p.pid in self._links]
            self._old_since = self._clock.monotonic()
            for position in self._positions:
                self._start(position)
        log.info("master: %s: %d workers", signal.Signals(signum).name, len(self._positions))

    def _retire_old_generation(self) -> None:
        """Once every new worker serves (or too long has passed), retire the old ones."""
        if not self._old_generation:
            return
        serving = len(self._serving()) == len(self._positions)
        if serving or self._clock.monotonic() - self._old_since > _NEW_GENERATION_WAIT_S:
            old, self._old_generation = self._old_generation, []
            self._retire([link.pid for link in old])

    def _reloaded(self) -> Settings | None:
        if self._reload is None:
            log.warning("master: SIGHUP received, but there is no configuration to reload")
            return None
        try:
            settings = self._reload()
            assert self._state is not None
            self._state.reconfigure(settings)  # its backends built here first, or refused
        except ConfigError as exc:
            log.error("master: SIGHUP: the new configuration is refused, keeping the old: %s", exc)
            return None
        if _ports(settings) != _ports(self._settings):
            log.warning(
                "master: SIGHUP: the listening address, the probes' and [metrics] "
                "cannot change on a reload; the group keeps its ports"
            )
        return settings

    def _retire(self, pids: list[int]) -> None:
        """Have each worker hand its connections to the others and exit (SIGTERM: drain)."""
        for pid in filter(None, pids):
            link = self._links.get(pid)
            if link is None:
                continue
            link.retiring = True
            if not (self._serving() and link.tell({"kind": "retire"})):
                send_signal(pid, signal.SIGTERM)

    def _stop_all(self, exit_code: int) -> int:
        assert self._listener is not None
        # The workers hold their own copies; once they close theirs, connects are refused.
        self._listener.close()
        self._positions.cancel_restarts()
        stop_workers(self._links, self._events, drain_time_s(self._settings), self._clock)
        log.info("master: all workers stopped; exiting %d", exit_code)
        return exit_code

    def _cancel_signal_handlers(self) -> None:
        for handler in self._signal_handlers:
            handler.cancel()
        self._signal_handlers = []


def _ports(settings: Settings) -> tuple[object, ...]:
    """What a reload cannot change: the group binds these once."""
    server = settings.server
    return server.host, server.port, server.probe_bind_host, server.probe_port, settings.metrics
