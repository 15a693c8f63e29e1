"""FerretDB 2 on PostgreSQL with DocumentDB: a real MongoDB-compatible engine for the tests.

``make compat`` builds the engine (``tests/compat/build-engine``): DocumentDB, pg_cron and
pgvector installed into Debian's PostgreSQL 15, and ``build/compat/bin/ferretdb``.
:class:`FerretDbServer` then runs one throwaway PostgreSQL cluster and one FerretDB in a
temporary directory of its own, on free loopback ports, and stops exactly those two
processes. It has the interface of :class:`service.samples.MongoWireServer` that the
tests use (``uri``, ``port``, ``start``, ``stop``, a context manager), so the
``mongo_server`` fixture can hand either out (``FANOUT_TEST_MONGO_ENGINE=ferretdb``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from service.samples.mongo_server import free_port, stop_process, wait_for_ping
from tests.support.toolchains import FERRETDB, PG_BIN, missing

__all__ = ["ENGINE_ENV", "ENGINES", "FerretDbServer", "FerretDbError", "selected_engine"]

#: ``nx-27017`` (default) or ``ferretdb``: the engine behind the ``mongo_server`` fixture.
#: Not ``FANOUT_MONGO_*``: the servers the tests start would read that as a ``[mongo]`` key.
ENGINE_ENV = "FANOUT_TEST_MONGO_ENGINE"
ENGINES = ("nx-27017", "ferretdb")

# What DocumentDB's own packaging (packaging/10-preload.sh) puts in postgresql.conf, and
# jit off: Debian's old LLVM bitcode for pg_cron would stay on disk beside 1.6.3.
_POSTGRESQL_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{socket_dir}'
jit = off
fsync = off
shared_preload_libraries = 'pg_cron,pg_documentdb_core,pg_documentdb'
cron.database_name = 'postgres'
documentdb.enableCompact = true
documentdb.enableLetAndCollationForQueryMatch = true
documentdb.enableNowSystemVariable = true
documentdb.enableSortbyIdPushDownToPrimaryKey = true
documentdb.enableSchemaValidation = true
documentdb.enableBypassDocumentValidation = true
documentdb.enableUserCrud = true
documentdb.maxUserLimit = 100
"""
_LOG_TAIL_CHARS = 2000


class FerretDbError(RuntimeError):
    """The engine is not built, or PostgreSQL or FerretDB did not become ready in time."""


def selected_engine() -> str:
    """The engine ``FANOUT_TEST_MONGO_ENGINE`` names; a typo is an error, never a silent default."""
    engine = os.environ.get(ENGINE_ENV, "") or "nx-27017"
    if engine not in ENGINES:
        raise FerretDbError(f"{ENGINE_ENV}={engine!r}: expected one of {', '.join(ENGINES)}")
    return engine


class FerretDbServer:
    """A PostgreSQL cluster with DocumentDB and a FerretDB in front, ready once started.

    PostgreSQL refuses to run as root; as root, its commands run as the ``postgres``
    user, which owns the cluster's directory.
    """

    def __init__(self, ready_timeout_s: float = 60.0, port: int = 0) -> None:
        self._ready_timeout_s = ready_timeout_s
        self._wanted_port = port  # 0: a free one
        self._workdir: Path | None = None
        self._pg_port: int | None = None
        self._port: int | None = None
        self._ferretdb: subprocess.Popen[bytes] | None = None
        self._console: IO[bytes] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise FerretDbError("the server is not started")
        return self._port

    @property
    def uri(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The engine's processes: PostgreSQL's postmaster (its backends are its children)
        and FerretDB; for measuring the database's CPU."""
        if self._workdir is None or self._ferretdb is None:
            raise FerretDbError("the server is not started")
        postmaster = (self._workdir / "data" / "postmaster.pid").read_text().split()[0]
        return [int(postmaster), self._ferretdb.pid]

    def start(self) -> FerretDbServer:
        """Initialise and start the cluster, create the extension, start FerretDB, ping it.

        Raises :class:`FerretDbError`, with the tail of the failing log, and stops what
        had started.
        """
        if self._ferretdb is not None:
            return self
        if not_here := missing("compat"):
            raise FerretDbError(f"engine not built ({', '.join(not_here)}): run make compat")
        self._workdir = Path(tempfile.mkdtemp(prefix="fanout-ferretdb-"))
        try:
            self._start_postgres(time.monotonic() + self._ready_timeout_s)
            self._start_ferretdb(time.monotonic() + self._ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop FerretDB, then PostgreSQL (fast shutdown), and remove the directory."""
        stop_process(self._ferretdb, timeout_s=5.0)
        self._ferretdb = None
        if self._console is not None:
            self._console.close()
            self._console = None
        if self._workdir is not None:
            if self._pg_port is not None and (self._workdir / "data" / "postmaster.pid").exists():
                self._postgres_command(
                    "pg_ctl",
                    "-D",
                    str(self._workdir / "data"),
                    "-m",
                    "fast",
                    "-w",
                    "stop",
                    check=False,
                )
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = self._pg_port = self._port = None

    def _start_postgres(self, deadline: float) -> None:
        assert self._workdir is not None
        if os.geteuid() == 0:
            shutil.chown(self._workdir, "postgres")
        data = self._workdir / "data"
        self._postgres_command(
            "initdb",
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        )
        self._pg_port = free_port()
        with open(data / "postgresql.conf", "a") as conf:
            conf.write(_POSTGRESQL_CONF.format(port=self._pg_port, socket_dir=self._workdir))
        timeout_s = max(1, int(deadline - time.monotonic()))
        self._postgres_command(
            "pg_ctl",
            "-D",
            str(data),
            "-l",
            str(self._workdir / "postgres.log"),
            "-w",
            "-t",
            str(timeout_s),
            "start",
            log=self._workdir / "postgres.log",
        )
        self._postgres_command(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self._pg_port),
            "-U",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            "CREATE EXTENSION documentdb CASCADE",
        )

    def _start_ferretdb(self, deadline: float) -> None:
        assert self._workdir is not None and self._pg_port is not None
        self._port = self._wanted_port or free_port()
        self._console = open(self._workdir / "ferretdb.log", "wb")
        self._ferretdb = subprocess.Popen(
            [
                str(FERRETDB),
                f"--postgresql-url=postgres://postgres@127.0.0.1:{self._pg_port}/postgres",
                f"--listen-addr=127.0.0.1:{self._port}",
                "--no-auth",
                "--telemetry=disable",
                "--debug-addr=-",
                f"--state-dir={self._workdir}",
                "--log-level=WARN",
            ],
            stdout=self._console,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        if not wait_for_ping(self.uri, self._ferretdb, deadline):
            raise FerretDbError(
                f"FerretDB did not answer ping on port {self._port}:\n"
                f"{_tail(self._workdir / 'ferretdb.log')}"
            )

    def _postgres_command(
        self, name: str, *args: str, check: bool = True, log: Path | None = None
    ) -> None:
        command = [str(PG_BIN / name), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
        if check and done.returncode != 0:
            tail = _tail(log) if log is not None else ""
            raise FerretDbError(
                f"{name} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr)[-_LOG_TAIL_CHARS:]}{tail}"
            )

    def __enter__(self) -> FerretDbServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError:
        return ""
