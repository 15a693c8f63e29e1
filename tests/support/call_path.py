"""The project files one warm ``get_app_stats`` runs on the server, traced, for the path
that ``docs/explanation/architecture.md`` writes down (``tests/test_call_path.py``).

The server runs in a process of its own with tracing off (``tracing.enabled =
false``), as the path is measured: the test process has a tracer provider and the
pymongo and requests instrumentations installed for the whole session, and a process
can install them only once. The call goes over a connection that has already served
two, so accepting it is not on the path. What runs in greenlets counts (the
connection's, and the task runners'); not the hub's own callbacks, not the backend
checks and the brownout controller that run on a schedule (``HealthChecker``, ``Dimmer``), not the
hub monitor's looks (a timer signal's handler, run inside whatever runs when it fires), not the
sample backends (``service/samples/``), not this module.

    python -m tests.support.call_path MONGO_URI DATABASE ALERTS_URL METRICS_URL
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["PROJECT_PACKAGES", "files_of_one_warm_call"]

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("service", "lookups", "tracing")
_SCHEDULED_BY_SIGNAL = "service/operations/hub_monitor.py"
_BACKEND_KEYS = ("mongo.uri", "mongo.database", "http.alerts_url", "http.metrics_url")


def files_of_one_warm_call(backends: dict[str, str]) -> set[str]:
    """The server's own files one warm call runs, traced in a server process of its own
    over ``backends`` (dotted settings keys, as ``backend_overrides`` gives them)."""
    command = [
        sys.executable,
        "-m",
        "gevent.monkey",
        "--module",
        "tests.support.call_path",
        *(backends[key] for key in _BACKEND_KEYS),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"tracing the call failed:\n{done.stderr[-4000:]}")
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _project_file(filename: str) -> str:
    """``filename`` relative to the checkout if it is one of the server's own, else ''."""
    try:
        relative = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return ""
    parts = relative.parts
    if parts[0] not in PROJECT_PACKAGES or parts[:2] == ("service", "samples"):
        return ""
    if str(relative) == _SCHEDULED_BY_SIGNAL:
        return ""
    return str(relative)


def _exchange(sock: socket.socket, call: bytes) -> bytes:
    sock.sendall(call)
    header = sock.recv(4, socket.MSG_WAITALL)
    size = struct.unpack("!i", header)[0]
    reply = b""
    while len(reply) < size:
        reply += sock.recv(size - len(reply))
    return reply


def _trace(address: tuple[str, int], call: bytes) -> set[str]:
    """The files ``call`` (a framed message) runs, once the same connection has served it twice."""
    import gevent

    with socket.create_connection(address, timeout=10) as sock:
        _exchange(sock, call)
        _exchange(sock, call)
        hub = gevent.get_hub()
        ran: set[str] = set()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                current = gevent.getcurrent()
                if current is not hub and not _scheduled(current):
                    name = _project_file(frame.f_code.co_filename)
                    if name:
                        ran.add(name)

        sys.setprofile(profile)
        try:
            _exchange(sock, call)
        finally:
            sys.setprofile(None)
    return ran


def _scheduled(greenlet: Any) -> bool:
    """A greenlet of the backend checks or of the brownout controller, which run on a
    schedule whatever the calls."""
    return any(
        getattr(arg, "__qualname__", "").startswith(("HealthChecker.", "Dimmer."))
        for arg in getattr(greenlet, "args", ())
    )


def main(mongo_uri: str, database: str, alerts_url: str, metrics_url: str) -> None:
    from service.app import FanOutService
    from service.idl import appstats
    from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
    from service.settings.config import load_settings
    from tests.support.samples import GENEROUS_BUDGETS
    from tests.support.thrift_calls import encode_call, frame

    # The profiler slows the call further: a panel out of budget would run the error
    # path's files instead.
    settings = load_settings(
        env={},
        overrides={
            "server.port": 0,
            "tracing.enabled": False,
            "mongo.uri": mongo_uri,
            "mongo.database": database,
            "http.alerts_url": alerts_url,
            "http.metrics_url": metrics_url,
            **GENEROUS_BUDGETS,
        },
    )
    service = FanOutService(settings).start()  # no tracer provider: tracing is off
    try:
        call = frame(
            encode_call(
                "get_app_stats",
                appstats.AppStats.get_app_stats_args(
                    request=appstats.StatsRequest(
                        app="shop", start_ms=SAMPLE_START_MS, end_ms=SAMPLE_END_MS
                    )
                ),
            )
        )
        print(json.dumps(sorted(_trace(service.address, call))))
    finally:
        service.stop()


if __name__ == "__main__":
    main(*sys.argv[1:5])
