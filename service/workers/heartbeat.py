"""Worker heartbeats: a stuck worker is found and replaced.

Each worker touches a file of its own (in a directory the master made, named
by the worker's serial number, which no other worker ever has) every ``BEAT_S``
from a greenlet of its event loop, as gunicorn's workers do. A worker whose
loop is blocked (a computation that never yields, a call into something gevent
did not patch, a deadlock, a SIGSTOP) stops touching it; the master, checking
twice a second, kills a worker whose file is older than
``server.worker_heartbeat_timeout_ms`` and restarts its position as for any death.
A new worker's file is dated :data:`START_GRACE_S` ahead, for the time it takes
to load and start serving, and each beat before it serves (:meth:`Heartbeats.announce`)
dates it that far ahead again: building a worker's parts may hold its loop longer than
the heartbeat timeout on a busy machine, which is a slow start, not a stuck worker.

A worker also announces itself there once it serves (:meth:`Heartbeats.announce`):
its pid and where its metrics are scraped, which the master's group endpoints
(``service.workers.group``) read. And it keeps its calls there
(:meth:`Heartbeats.calls_path`, :mod:`tracing.call_tally`), which the master counts once
it has gone, however it went.

A master removes its directory as it exits; one killed outright (SIGKILL, the OOM killer)
cannot. So a new master removes the directories of masters that are gone
(:func:`remove_abandoned`): its pid file names no process, and nothing in the directory
has changed for :data:`ABANDONED_AFTER_S`, which no live group's beats allow.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import gevent

from lookups.clock import SYSTEM_CLOCK, Clock
from tracing.context import spawn_in_context

__all__ = [
    "Heartbeats",
    "BEAT_S",
    "ABANDONED_AFTER_S",
    "ProcessState",
    "process_state",
    "looks_stuck",
    "remove_abandoned",
]

BEAT_S = 0.5
#: How long a new worker may take to beat for the first time.
START_GRACE_S = 15.0
#: How long a directory whose master is gone stays untouched before another master removes it.
ABANDONED_AFTER_S = 600.0
_PREFIX = "fanout-heartbeat-"
_MASTER_PID = "master.pid"


class Heartbeats:
    """The directory of heartbeat files, one per worker (``worker``: its serial number).

    The master makes it (``directory`` None); a worker opens the one it is given. Beats
    are dated, and ages read, on ``clock``'s wall time: a test moves it and a beat ages.
    """

    def __init__(self, directory: str | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        if directory:
            self._dir = Path(directory)
        else:
            remove_abandoned(Path(tempfile.gettempdir()), now=clock.wall())
            self._dir = Path(tempfile.mkdtemp(prefix=_PREFIX))
            (self._dir / _MASTER_PID).write_text(str(os.getpid()))
        self._serving = False  # in a worker: whether it announced that it serves

    @property
    def directory(self) -> str:
        return str(self._dir)

    def path(self, worker: int) -> Path:
        return self._dir / f"worker-{worker}"

    def reset(self, worker: int) -> None:
        """Before ``worker`` starts: it has :data:`START_GRACE_S` to beat, nothing announced."""
        self.path(worker).touch()
        self._date(self.path(worker), START_GRACE_S)
        self._announcement(worker).unlink(missing_ok=True)

    def forget(self, worker: int) -> None:
        """Once ``worker`` has exited: its files go."""
        self.path(worker).unlink(missing_ok=True)
        self._announcement(worker).unlink(missing_ok=True)
        self.calls_path(worker).unlink(missing_ok=True)

    def calls_path(self, worker: int) -> Path:
        """Where ``worker`` keeps its calls (:mod:`tracing.call_tally`)."""
        return self._dir / f"worker-{worker}.calls"

    def _announcement(self, worker: int) -> Path:
        return self._dir / f"worker-{worker}.json"

    def announce(self, worker: int, **facts: Any) -> None:
        """In the worker: say that it serves, with ``facts`` (its pid is added); its beats
        count from now on."""
        self._serving = True
        self._date(self.path(worker))
        partial = self._dir / f".worker-{worker}.json.part"
        partial.write_text(json.dumps({**facts, "pid": os.getpid()}))
        partial.replace(self._announcement(worker))  # atomic: never read half-written

    def announcement(self, worker: int) -> dict[str, Any] | None:
        """What ``worker`` announced, or None before it serves."""
        try:
            announced: dict[str, Any] = json.loads(self._announcement(worker).read_text())
            return announced
        except (FileNotFoundError, ValueError):
            return None

    def announced_by(self, worker: int, pid: int) -> dict[str, Any] | None:
        """What ``worker`` announced, if the process ``pid`` announced it (not a predecessor's
        file), or None."""
        announced = self.announcement(worker) if pid else None
        return announced if announced is not None and announced.get("pid") == pid else None

    def age_s(self, worker: int) -> float:
        """Seconds since ``worker`` last beat (0 when there is no file, or in its start grace)."""
        try:
            return max(0.0, self._clock.wall() - self.path(worker).stat().st_mtime)
        except FileNotFoundError:
            return 0.0

    def start_beating(self, worker: int) -> gevent.Greenlet:
        """In the worker: touch its file every ``BEAT_S`` while the event loop runs (dated
        :data:`START_GRACE_S` ahead until it announces that it serves)."""
        path = self.path(worker)

        def beat() -> None:
            while True:
                self._date(path, 0.0 if self._serving else START_GRACE_S)
                self._clock.sleep(BEAT_S)

        return spawn_in_context(beat)

    def _date(self, path: Path, ahead_s: float = 0.0) -> None:
        """Date ``path`` ``ahead_s`` past the clock's wall time: a beat."""
        at = self._clock.wall() + ahead_s
        try:
            os.utime(path, (at, at))
        except OSError:
            pass  # the master is going away with its directory

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def remove_abandoned(parent: Path, now: float, quiet_s: float = ABANDONED_AFTER_S) -> list[Path]:
    """Remove the heartbeat directories in ``parent`` whose master is gone and in which
    nothing changed for ``quiet_s`` before ``now`` (wall time); the ones removed. A directory
    without a pid file (a master still writing it, or an older version's) is judged by its
    quiet alone."""
    removed = []
    for directory in parent.glob(f"{_PREFIX}*"):
        try:
            if _master_alive(directory) or now - _last_change(directory) < quiet_s:
                continue
        except OSError:
            continue  # removed meanwhile, or not ours to read
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _master_alive(directory: Path) -> bool:
    try:
        pid = int((directory / _MASTER_PID).read_text())
    except FileNotFoundError:
        return False
    except ValueError:
        return True  # being written: its master is starting
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _last_change(directory: Path) -> float:
    """The latest modification time of ``directory`` and its files (beats date them)."""
    times = [directory.stat().st_mtime]
    for entry in directory.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


class ProcessState(NamedTuple):
    """What the kernel says of a process: its state letter (``R`` runnable, ``S`` asleep,
    ``T`` stopped, ...) and the CPU seconds it has used."""

    state: str
    cpu_s: float


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_state(pid: int) -> ProcessState | None:
    """``pid``'s state from ``/proc``, or None where it cannot be read (gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
    try:
        return ProcessState(fields[0], (int(fields[11]) + int(fields[12])) / _TICKS_PER_S)
    except (IndexError, ValueError):
        return None


def looks_stuck(state: ProcessState | None, cpu_since_beat_s: float, timeout_s: float) -> bool:
    """Whether a worker that has not beaten for ``timeout_s`` is stuck, not starved.

    A heartbeat is wall time, and so is a machine whose cores other work takes: a worker
    runnable (``R``) that has used less than half the timeout's CPU since its last beat
    was waiting for a core, and beats once it has one. Stuck is a worker that is not
    runnable (stopped, or asleep in something that never returns to its loop), or one
    that ran that long without returning to its loop to beat.
    """
    if state is None:
        return True
    return state.state != "R" or cpu_since_beat_s >= timeout_s / 2
