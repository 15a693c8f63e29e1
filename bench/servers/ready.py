"""The one line a benchmark process prints on stdout once it serves: ``READY {json}``.

Every process :mod:`bench.harness.stack` starts (backends, sink, baseline servers) announces
itself this way, so the stack learns the ports chosen by the kernel (every server binds
port 0) without guessing or sleeping. ``fanout serve`` prints its own line instead
(``fanout: serving on HOST:PORT``), which :func:`parse_ready` reads too.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from typing import Any

__all__ = ["READY_PREFIX", "announce_ready", "parse_ready", "wait_for_stop_signal"]

READY_PREFIX = "READY "
_FANOUT_SERVING = re.compile(r"serving on (?P<host>[0-9.]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)")


def announce_ready(**facts: Any) -> None:
    """Print ``READY {facts as JSON}`` and flush: the process serves from now on."""
    sys.stdout.write(READY_PREFIX + json.dumps(facts, sort_keys=True) + "\n")
    sys.stdout.flush()


def parse_ready(line: str) -> dict[str, Any] | None:
    """The facts announced on ``line``, or ``None`` when it is not a readiness line.

    ``fanout serve``'s ``serving on HOST:PORT`` gives ``{"host": HOST, "port": PORT}``.
    """
    if line.startswith(READY_PREFIX):
        try:
            facts = json.loads(line[len(READY_PREFIX) :])
        except ValueError:
            return None
        return facts if isinstance(facts, dict) else None
    match = _FANOUT_SERVING.search(line)
    if match is None:
        return None
    return {"host": match.group("host").strip("[]"), "port": int(match.group("port"))}


def wait_for_stop_signal() -> None:
    """Block the calling greenlet until SIGTERM or SIGINT arrives (gevent processes)."""
    import gevent
    from gevent.event import Event

    stop = Event()
    handlers = [gevent.signal_handler(sig, stop.set) for sig in (signal.SIGTERM, signal.SIGINT)]
    try:
        # A timed wait keeps the event loop alive even with nothing else on it
        # (signal watchers alone do not).
        while not stop.wait(timeout=60.0):
            pass
    finally:
        for handler in handlers:
            handler.cancel()
