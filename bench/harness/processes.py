"""One benchmark process: started fresh, awaited until it announces itself, measured, torn down.

Each process writes stdout and stderr to its own log file; :meth:`ManagedProcess.wait_ready`
reads that file until the readiness line (:func:`bench.servers.ready.parse_ready`) appears, the
process exits, or the deadline passes. Reading a file, not a pipe, means a chatty
process can never block on a full pipe nobody drains.

On Linux each child is started with ``PR_SET_PDEATHSIG`` (SIGTERM), so it goes away
even if the benchmark itself is killed, and with its soft ``RLIMIT_NOFILE`` raised to
the hard limit (the 10,000-connection scenario needs more than the usual 1024).
The death signal follows the *thread* that started the child: start stacks from the
main thread (or from greenlets, which all live in it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.servers.ready import parse_ready

__all__ = ["ProcessStartError", "ManagedProcess", "raise_nofile_limit", "child_environment"]

log = logging.getLogger(__name__)

_POLL_S = 0.02
_LOG_TAIL_CHARS = 3000
_PR_SET_PDEATHSIG = 1
_libc_name = ctypes.util.find_library("c")
# Loaded here, in the parent: the child between fork and exec should only make the call.
_LIBC = ctypes.CDLL(_libc_name, use_errno=True) if _libc_name else None


class ProcessStartError(RuntimeError):
    """A process exited or stayed silent instead of announcing it was ready."""


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return ``(soft, hard)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def _prepare_child() -> None:
    # Runs in the child between fork and exec: only async-signal-safe work here.
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    raise_nofile_limit()


class ManagedProcess:
    """A child process with a role (``"server"``, ``"mongo"``, ...) and a log file."""

    def __init__(
        self,
        role: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.role = role
        self.argv = list(argv)
        self.log_path = log_path
        self._env = env
        self._cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None
        self.facts: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RuntimeError(f"{self.role}: not started")
        return self._popen.pid

    def spawn(self) -> ManagedProcess:
        """Start the process (it is not ready yet: see :meth:`wait_ready`)."""
        with self.log_path.open("ab") as log_file:
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._env,
                cwd=self._cwd,
                preexec_fn=_prepare_child,
            )
        return self

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        """The facts of the readiness line (``time.monotonic()`` deadline).

        Raises :class:`ProcessStartError`, with the log's tail, if the process exits
        first or the deadline passes.
        """
        if self._popen is None:
            raise RuntimeError(f"{self.role}: not started")
        offset = 0
        pending = ""
        while True:
            with self.log_path.open("rb") as log_file:
                log_file.seek(offset)
                chunk = log_file.read()
            offset += len(chunk)
            pending += chunk.decode("utf-8", "replace")
            *lines, pending = pending.split("\n")
            for line in lines:
                facts = parse_ready(line)
                if facts is not None:
                    self.facts = facts
                    return facts
            if self._popen.poll() is not None:
                raise ProcessStartError(
                    f"{self.role} exited with status {self._popen.returncode} "
                    f"before it was ready; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise ProcessStartError(
                    f"{self.role} was not ready in time; log tail:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def processes(self) -> list[psutil.Process]:
        """The process and its live descendants (pre-forked workers, nx-27017)."""
        if self._popen is None or self._popen.poll() is not None:
            return []
        try:
            root = psutil.Process(self._popen.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self) -> float:
        """User plus system CPU of the process, its live descendants and its reaped children."""
        total = 0.0
        for index, process in enumerate(self.processes()):
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
            if index == 0:
                total += times.children_user + times.children_system
        return total

    def rss_kib(self) -> int:
        """Resident memory of the process and its live descendants, in KiB."""
        total = 0
        for process in self.processes():
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        return total // 1024

    def nofile_limit(self) -> int | None:
        """The process's soft ``RLIMIT_NOFILE``, or ``None`` if it cannot be read."""
        if self._popen is None:
            return None
        try:
            return int(psutil.Process(self._popen.pid).rlimit(psutil.RLIMIT_NOFILE)[0])
        except (psutil.Error, AttributeError):
            return None

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; the same for leftover descendants.

        Returns the exit status (negative: killed by that signal); idempotent.
        """
        popen, self._popen = self._popen, None
        if popen is None:
            return None
        descendants = []
        if popen.poll() is None:
            try:
                descendants = psutil.Process(popen.pid).children(recursive=True)
            except psutil.Error:
                pass
            popen.terminate()
            try:
                popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s did not stop within %.0f s of SIGTERM; killing it", self.role, timeout_s
                )
                popen.kill()
                popen.wait(timeout=timeout_s)
        _end_processes(descendants, timeout_s)
        return popen.returncode

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return text[-_LOG_TAIL_CHARS:] or "(empty log)"

    def __repr__(self) -> str:
        state = "not started" if self._popen is None else f"pid {self._popen.pid}"
        return f"<ManagedProcess {self.role} {state}>"


def _end_processes(processes: list[psutil.Process], timeout_s: float) -> None:
    alive = [p for p in processes if p.is_running()]
    for process in alive:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, still_alive = psutil.wait_procs(alive, timeout=timeout_s)
    for process in still_alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still_alive, timeout=timeout_s)


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ``FANOUT_*`` and ``OTEL_*`` (the config file decides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FANOUT_", "OTEL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env
