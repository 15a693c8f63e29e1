"""Fresh benchmark stacks: backends, an optional OTLP sink and one Thrift server, each its own process.

    with start_stack(StackSpec(server="fanout", delay_ms=20)) as stack:
        host, port = stack.address          # framed transport, binary protocol
        ...                                 # drive load
        stack.cpu_seconds()                 # {"server": s, "mongo": s, "http": s, "otlp": s}

Every process is started for the stack and ended with it (SIGTERM, then SIGKILL after
a timeout), also when the ``with`` body raises, so no configuration inherits another's
connections, caches or warm pools. What runs:

=================  ==========================================================================
mongo "responder"  ``python -m bench.servers.mongo_responder``: answers recorded from nx-27017,
                   after ``delay_ms`` per operation, tens of microseconds of CPU each
mongo "nx"         ``python -m bench.servers.nx_backend``: nx-27017 seeded with the sample data;
                   real queries, no added delay
http               ``python -m bench.servers.http_backend``: the sample alerts and metrics answers,
                   cached, after ``delay_ms`` per request
otlp               ``python -m bench.servers.otlp_sink`` (tracing "ratio1", "ratio10" or "full" only)
server "fanout"    ``python -m service.cli serve --config FILE``
server "sequential", "threaded", "bare", "handwritten", "refusing"
                   ``python -m bench.baselines.<name> --config FILE``
server "asyncio"   ``python -m bench.baselines.asyncio_peer --config FILE`` (uvloop, aiohttp)
=================  ==========================================================================

All servers read the same generated TOML file (:mod:`bench.harness.stack_config`). A stack is ready
once its server answers ``ping`` over Thrift; nothing waits on a timer.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from thriftpy2.protocol import TCyBinaryProtocolFactory
from thriftpy2.rpc import make_client
from thriftpy2.transport import TCyFramedTransportFactory, TTransportException

from bench.harness.processes import (
    ManagedProcess,
    ProcessStartError,
    child_environment,
    raise_nofile_limit,
)
from bench.harness.stack_config import SAMPLE_RATIOS, stack_config
from bench.servers.mongo_answers import DEFAULT_ANSWERS_PATH
from bench.servers.mongo_responder import STATS_COMMAND
from service.idl import appstats

__all__ = [
    "SERVERS",
    "MONGO_BACKENDS",
    "TRACING_MODES",
    "StackSpec",
    "Stack",
    "StackError",
    "start_stack",
]

log = logging.getLogger(__name__)

SERVERS = ("fanout", "sequential", "threaded", "bare", "handwritten", "asyncio", "refusing")
MONGO_BACKENDS = ("responder", "nx")
TRACING_MODES = ("off", *SAMPLE_RATIOS)
ROLES = ("server", "mongo", "http", "otlp")
_SERVER_MODULES = {
    "fanout": ["service.cli", "serve"],
    "sequential": ["bench.baselines.sequential"],
    "threaded": ["bench.baselines.threaded"],
    "bare": ["bench.baselines.bare"],
    "handwritten": ["bench.baselines.handwritten"],
    "asyncio": ["bench.baselines.asyncio_peer"],
    "refusing": ["bench.baselines.refusing"],
}
_REPO = Path(__file__).resolve().parents[2]
_FD_HEADROOM = 1000  # descriptors beyond the connections: backends, logs, the listener
_STOP_TIMEOUT_S = 15.0  # the server drains for up to 2 s (server.drain_timeout_ms)
_PING_TIMEOUT_MS = 1000
_POLL_S = 0.02


class StackError(RuntimeError):
    """The stack could not start: a process exited or was not ready in time."""


@dataclass(frozen=True)
class StackSpec:
    """What one benchmark configuration runs. Construction raises ``ValueError`` for bad values."""

    server: str  # one of SERVERS
    mongo: str = "responder"  # "responder" | "nx"
    delay_ms: int = 20  # added to every MongoDB-wire (responder only) and HTTP operation
    workers: int = 1  # fanout only
    tracing: str = "off"  # "off" or a mode of SAMPLE_RATIOS; fanout only
    max_connections: int = 12_000
    pool_size: int = 200  # mongo.max_pool_size and http.pool_maxsize
    # "adaptive" (the defaults) | "one" (a limit of one call, refusals not held) | "one-held"
    admission: str = "adaptive"
    # Off unless a scenario is about it: every other scenario sends the same app and window
    # on every call, and sharing those calls would compare unequal work with the baselines.
    coalesce: bool = False  # fanout.coalesce
    merge_commands: bool = False  # fanout.merge_commands
    # Another CPython for the server alone (bench.harness.pythons); "" = this interpreter.
    python: str = ""
    brownout: bool = True  # admission.brownout: false is the server before brownout
    fair_share: bool = True  # admission.fair_share
    callers: tuple[tuple[str, float], ...] = ()  # [callers.<name>] weight, by name
    # server.hub_block_threshold_ms at its default (the monitor on, as shipped) or 0 (off).
    hub_monitor: bool = False
    # Every Nth request of each HTTP service answered with a body cut short: a failed panel.
    http_fail_every: int = 0
    # tracing.tail_max_per_s: 0 leaves it as shipped.
    tail_max_per_s: int = 0

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("server", self.server, SERVERS),
            ("mongo", self.mongo, MONGO_BACKENDS),
            ("tracing", self.tracing, TRACING_MODES),
        ):
            if value not in choices:
                raise ValueError(f"StackSpec.{name}: one of {', '.join(choices)}, got {value!r}")
        if (
            self.delay_ms < 0
            or self.workers < 1
            or self.max_connections < 1
            or self.pool_size < 2
            or self.tail_max_per_s < 0
        ):
            raise ValueError(
                "StackSpec: delay_ms >= 0, workers >= 1, max_connections >= 1, pool_size >= 2, "
                "tail_max_per_s >= 0"
            )
        if self.admission not in ("adaptive", "one", "one-held"):
            raise ValueError(
                f"StackSpec.admission: adaptive, one or one-held, got {self.admission!r}"
            )
        if self.server != "fanout" and (self.workers != 1 or self.tracing != "off" or self.python):
            raise ValueError(
                "StackSpec: workers, tracing and python apply to the fanout server only"
            )


class Stack:
    """A running stack; a context manager that tears every process down on exit."""

    def __init__(self, spec: StackSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.address: tuple[str, int] = ("", 0)
        self.startup_s = 0.0
        self.processes: dict[str, ManagedProcess] = {}
        self._mongo: Any = None  # a client of the responder, for mongo_aggregations
        self._closed = False

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative user+system CPU per role (0.0 for a role not running in this stack)."""
        return {
            role: self.processes[role].cpu_seconds() if role in self.processes else 0.0
            for role in ROLES
        }

    def rss_kib(self) -> dict[str, int]:
        """Current RSS per role, in KiB; the server's is the sum over its workers."""
        return {
            role: self.processes[role].rss_kib() if role in self.processes else 0 for role in ROLES
        }

    def server_pids(self) -> list[int]:
        """The server process and its live descendants (pre-forked workers)."""
        return [process.pid for process in self.processes["server"].processes()]

    def nofile_limit(self) -> int | None:
        """The server process's soft RLIMIT_NOFILE."""
        return self.processes["server"].nofile_limit()

    def otlp_stats(self) -> dict[str, int] | None:
        """``{"requests", "bytes"}`` the OTLP sink received so far; ``None`` without a sink."""
        sink = self.processes.get("otlp")
        if sink is None:
            return None
        from urllib.request import urlopen

        with urlopen(sink.facts["stats_url"], timeout=5) as answer:
            received: dict[str, int] = json.loads(answer.read())
            return received

    def mongo_aggregations(self) -> int | None:
        """Aggregations the MongoDB responder has answered so far; ``None`` with nx-27017."""
        if self.spec.mongo != "responder":
            return None
        if self._mongo is None:
            import pymongo

            self._mongo = pymongo.MongoClient(self.processes["mongo"].facts["uri"], timeoutMS=5000)
        answered: int = self._mongo.admin.command(STATS_COMMAND)["aggregations"]
        return answered

    def describe(self) -> dict[str, Any]:
        """The spec and, in words, which backends this stack used (for the results)."""
        spec = self.spec
        delay = f"+{spec.delay_ms} ms per operation"
        mongo = (
            f"light MongoDB-wire responder replaying answers recorded from nx-27017, {delay}"
            if spec.mongo == "responder"
            else "nx-27017 (MongoDB wire over SQLite, in memory), real queries, no added delay"
        )
        return {
            **asdict(spec),
            "startup_s": round(self.startup_s, 3),
            "backends": {
                "mongo": mongo,
                "http": f"lean gevent HTTP responder with the sample alerts/metrics answers, {delay}",
                "otlp": "local OTLP/HTTP sink" if "otlp" in self.processes else "none",
            },
        }

    def close(self) -> None:
        """Stop the server (it drains and flushes spans), then the sink and the backends."""
        if self._closed:
            return
        self._closed = True
        if self._mongo is not None:
            self._mongo.close()
        for role in ROLES:
            process = self.processes.get(role)
            if process is not None:
                status = process.stop(_STOP_TIMEOUT_S)
                if status not in (0, None, -15):  # -15: ended by our SIGTERM
                    log.warning(
                        "%s exited with status %s; log tail:\n%s", role, status, process.log_tail()
                    )
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        host, port = self.address
        return f"<Stack {self.spec.server} on {host}:{port} mongo={self.spec.mongo}>"


def start_stack(spec: StackSpec, timeout_s: float = 60.0) -> Stack:
    """Start a fresh stack for ``spec`` and return it once its server answers ``ping``.

    Raises :class:`StackError` (with the failing process's log tail) when a process
    exits or is not ready within ``timeout_s``; whatever had started is stopped first.
    """
    interpreter = _server_interpreter(spec)  # first: making its environment may take minutes
    started = time.monotonic()
    deadline = started + timeout_s
    raise_nofile_limit()  # for the load generator in this process; children raise their own
    stack = Stack(spec, Path(tempfile.mkdtemp(prefix=f"fanout-bench-{spec.server}-")))
    try:
        _start_backends(stack, deadline)
        _start_server(stack, interpreter, deadline)
    except BaseException as exc:
        stack.close()
        if isinstance(exc, ProcessStartError):
            raise StackError(str(exc)) from None
        raise
    stack.startup_s = time.monotonic() - started
    _check_nofile_limit(stack)
    return stack


def _server_interpreter(spec: StackSpec) -> str:
    if not spec.python:
        return sys.executable
    from bench.harness.interpreters import server_interpreter

    try:
        return server_interpreter(spec.python)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise StackError(f"no environment for {spec.python}: {exc}") from None


def _python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def _start_backends(stack: Stack, deadline: float) -> None:
    spec = stack.spec
    delay = str(spec.delay_ms)
    commands = {
        "mongo": (
            _python_module(
                "bench.servers.mongo_responder",
                "--port",
                "0",
                "--delay-ms",
                delay,
                "--answers",
                str(DEFAULT_ANSWERS_PATH),
            )
            if spec.mongo == "responder"
            else _python_module("bench.servers.nx_backend")
        ),
        "http": _python_module(
            "bench.servers.http_backend",
            "--delay-ms",
            delay,
            "--fail-every",
            str(spec.http_fail_every),
        ),
    }
    if spec.tracing != "off":
        commands["otlp"] = _python_module("bench.servers.otlp_sink")
    # Started together, awaited one by one: start-up overlaps.
    for role, argv in commands.items():
        stack.processes[role] = _process(stack, role, argv).spawn()
    for role in commands:
        stack.processes[role].wait_ready(deadline)


def _start_server(stack: Stack, interpreter: str, deadline: float) -> None:
    facts = {role: process.facts for role, process in stack.processes.items()}
    config = stack.workdir / "bench.toml"
    config.write_text(
        stack_config(
            stack.spec,
            facts["mongo"]["uri"],
            facts["http"]["alerts_url"],
            facts["http"]["metrics_url"],
            facts.get("otlp", {}).get("endpoint"),
        )
    )
    argv = [interpreter, "-m", *_SERVER_MODULES[stack.spec.server], "--config", str(config)]
    server = stack.processes["server"] = _process(stack, "server", argv).spawn()
    ready = server.wait_ready(deadline)
    stack.address = (ready["host"], int(ready["port"]))
    _wait_for_ping(stack.address, server, deadline)


def _process(
    stack: Stack, role: str, argv: list[str], env: dict[str, str] | None = None
) -> ManagedProcess:
    return ManagedProcess(
        role, argv, stack.workdir / f"{role}.log", env=child_environment(env), cwd=_REPO
    )


def _wait_for_ping(address: tuple[str, int], server: ManagedProcess, deadline: float) -> None:
    """Call ``ping`` until it answers ``pong``; raises ProcessStartError at the deadline."""
    host, port = address
    while True:
        try:
            client = make_client(
                appstats.AppStats,
                host,
                port,
                proto_factory=TCyBinaryProtocolFactory(),
                trans_factory=TCyFramedTransportFactory(),
                timeout=_PING_TIMEOUT_MS,
            )
            try:
                if client.ping() == "pong":
                    return
            finally:
                client.close()
        except (TimeoutError, TTransportException, OSError):
            pass
        if not server.processes() or time.monotonic() >= deadline:
            raise ProcessStartError(
                f"server on {host}:{port} did not answer ping; log tail:\n{server.log_tail()}"
            )
        time.sleep(_POLL_S)


def _check_nofile_limit(stack: Stack) -> None:
    limit = stack.nofile_limit()
    wanted = stack.spec.max_connections + _FD_HEADROOM
    if limit is not None and limit < wanted:
        log.warning(
            "server RLIMIT_NOFILE is %d, below the %d that %d connections need; "
            "raise the hard limit (ulimit -Hn)",
            limit,
            wanted,
            stack.spec.max_connections,
        )
