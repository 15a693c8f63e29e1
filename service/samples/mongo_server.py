"""An embedded MongoDB-wire server: ``nx-27017 --db memory`` in a subprocess on a free port.

Each instance has its own temporary directory for its pid file and log file; the
server refuses to start when another instance already owns the default pid file.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import pymongo
from pymongo.errors import PyMongoError

__all__ = [
    "MongoWireServer",
    "MongoWireServerError",
    "find_executable",
    "free_port",
    "stop_process",
    "wait_for_ping",
]

_EXECUTABLE = "nx-27017"
_START_ATTEMPTS = 3  # a free port can be taken by someone else before we bind it
_PING_TIMEOUT_MS = 250
_LOG_TAIL_CHARS = 2000


class MongoWireServerError(RuntimeError):
    """The embedded server could not be found or did not become ready in time."""


def find_executable() -> str:
    """The ``nx-27017`` next to this interpreter (its virtual environment) or on PATH.

    Raises :class:`MongoWireServerError` when neither exists.
    """
    beside = Path(sys.executable).parent / _EXECUTABLE
    if beside.exists():
        return str(beside)
    on_path = shutil.which(_EXECUTABLE)
    if on_path is None:
        raise MongoWireServerError(
            f"{_EXECUTABLE} not found next to {sys.executable} or on PATH; "
            "install it with: pip install 'fanout[demo]'"
        )
    return on_path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free now, below the kernel's range of ephemeral ports.

    The kernel's pick for port 0 comes from that range, the one it also gives outgoing
    connections their local ports from: between this pick and the server's bind, one of
    the many connections a busy machine opens could take it ("Address already in use").
    Below the range only another listener can. The kernel's pick when none is free there.
    """
    low = _ephemeral_low()
    for port in random.sample(range(_LISTEN_LOW, low), min(64, max(0, low - _LISTEN_LOW))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


#: The lowest port :func:`free_port` hands out: past the well-known and most registered ones.
_LISTEN_LOW = 20_000


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def stop_process(
    process: subprocess.Popen[Any] | None, timeout_s: float, kill_wait_s: float | None = None
) -> None:
    """SIGTERM ``process``, wait up to ``timeout_s``, then SIGKILL it and wait up to
    ``kill_wait_s`` (default ``timeout_s``) to reap it. Nothing for None or one that ended."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s if kill_wait_s is None else kill_wait_s)


def wait_for_ping(uri: str, process: subprocess.Popen[bytes] | None, deadline: float) -> bool:
    """Ping the server at ``uri`` until it answers (True), ``process`` (the server's) exits,
    or ``deadline`` (monotonic seconds) passes (False)."""
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(
        uri,
        directConnection=True,
        serverSelectionTimeoutMS=_PING_TIMEOUT_MS,
        connectTimeoutMS=_PING_TIMEOUT_MS,
        appname="fanout-readiness",
    )
    try:
        while time.monotonic() < deadline:
            if process is None or process.poll() is not None:
                return False
            try:
                # Each failed ping waits up to the selection timeout: this polls
                # readiness at that pace rather than sleeping.
                with pymongo.timeout(_PING_TIMEOUT_MS / 1000):
                    client.admin.command("ping")
                return True
            except PyMongoError:
                continue
        return False
    finally:
        client.close()


class MongoWireServer:
    """One in-memory MongoDB-wire server process, ready to serve once :meth:`start` returns.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. :meth:`kill` ends
    the process abruptly (SIGKILL), as a crash would.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 15.0,
        executable: str | None = None,
        port: int = 0,
    ) -> None:
        self._host = host
        self._fixed_port = port  # 0: a free port
        self._ready_timeout_s = ready_timeout_s
        self._executable = executable
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._console: IO[bytes] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise MongoWireServerError("the server is not started")
        return self._port

    @property
    def uri(self) -> str:
        """``mongodb://host:port`` of the running server."""
        return f"mongodb://{self._host}:{self.port}"

    @property
    def workdir(self) -> Path | None:
        """The directory holding the server's pid file and logs while it runs."""
        return self._workdir

    def pids(self) -> list[int]:
        """The server's process, for measuring the database's CPU (as FerretDB's ``pids``)."""
        if self._process is None:
            raise MongoWireServerError("the server is not started")
        return [self._process.pid]

    def start(self) -> MongoWireServer:
        """Start the process and wait until it answers ``ping``.

        Raises :class:`MongoWireServerError`, with the tail of the server's log, when it
        exits or does not answer within ``ready_timeout_s``.
        """
        if self._process is not None:
            return self
        executable = self._executable or find_executable()
        self._workdir = Path(tempfile.mkdtemp(prefix="fanout-mongo-"))
        deadline = time.monotonic() + self._ready_timeout_s
        # A fixed port gets one try: another process holding it will not let go.
        for _ in range(1 if self._fixed_port else _START_ATTEMPTS):
            self._spawn(executable, self._fixed_port or free_port(self._host))
            if self._wait_ready(deadline):
                return self
            if self._still_running():
                break  # still running but not answering: retrying will not help
        tail = self._log_tail()
        self.stop()
        raise MongoWireServerError(
            f"{_EXECUTABLE} did not become ready within "
            f"{self._ready_timeout_s:.0f}s; log tail:\n{tail}"
        )

    def _still_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _spawn(self, executable: str, port: int) -> None:
        assert self._workdir is not None
        self._close_console()
        # A process that died on a taken port may leave its pid file behind.
        (self._workdir / "server.pid").unlink(missing_ok=True)
        self._console = (self._workdir / "console.log").open("ab")
        self._port = port
        self._process = subprocess.Popen(
            [
                executable,
                "--db",
                "memory",
                "--host",
                self._host,
                "--port",
                str(port),
                "--pid-file",
                str(self._workdir / "server.pid"),
                "--log-file",
                str(self._workdir / "server.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
        )

    def _wait_ready(self, deadline: float) -> bool:
        """Ping until it answers (True), the process exits or the deadline passes (False)."""
        return wait_for_ping(self.uri, self._process, deadline)

    def _log_tail(self) -> str:
        texts = []
        for name in ("console.log", "server.log"):
            path = self._workdir / name if self._workdir is not None else None
            if path is not None and path.exists():
                texts.append(path.read_text(errors="replace")[-_LOG_TAIL_CHARS:])
        return "\n".join(texts) or "(no log output)"

    def kill(self) -> None:
        """End the process with SIGKILL and reap it; :meth:`stop` still cleans up."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate, wait up to ``timeout_s``, then kill; remove the files. Idempotent."""
        process, self._process = self._process, None
        stop_process(process, timeout_s)
        self._close_console()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _close_console(self) -> None:
        if self._console is not None:
            self._console.close()
            self._console = None

    def __enter__(self) -> MongoWireServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = (
            "running" if self._process is not None and self._process.poll() is None else "stopped"
        )
        return f"<MongoWireServer {self._host}:{self._port} {state}>"
