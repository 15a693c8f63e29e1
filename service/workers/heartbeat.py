"""Worker heartbeats: a stuck worker is found and replaced.

Each worker touches a file of its own (in a directory the master made) every
``BEAT_S`` from a greenlet of its event loop, as gunicorn's workers do. A
worker whose loop is blocked (a computation that never yields, a call into
something gevent did not patch, a deadlock) stops touching it; the master,
checking every second, kills a worker whose file is older than
``server.worker_heartbeat_timeout_ms`` and restarts its slot as for any death.

A worker also announces itself there once it serves (:meth:`Heartbeats.announce`):
its pid and where its metrics are scraped, which the master's group endpoints
(``service.workers.group``) read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import gevent

from tracing.greenlets import spawn_in_context

__all__ = ["Heartbeats", "BEAT_S"]

BEAT_S = 1.0


class Heartbeats:
    """The master's directory of heartbeat files, one per worker slot."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="fanout-heartbeat-"))

    def path(self, slot: int) -> Path:
        return self._dir / f"slot-{slot}"

    def reset(self, slot: int) -> None:
        """Before a worker starts in ``slot``: its clock starts now, its announcement is gone."""
        self.path(slot).touch()
        os.utime(self.path(slot))
        self._announcement(slot).unlink(missing_ok=True)

    def _announcement(self, slot: int) -> Path:
        return self._dir / f"slot-{slot}.json"

    def announce(self, slot: int, **facts: Any) -> None:
        """In the worker: say that it serves, with ``facts`` (its pid is added)."""
        partial = self._dir / f".slot-{slot}.json.part"
        partial.write_text(json.dumps({**facts, "pid": os.getpid()}))
        partial.replace(self._announcement(slot))  # atomic: never read half-written

    def announcement(self, slot: int) -> Optional[dict[str, Any]]:
        """What the worker in ``slot`` announced, or None before it serves."""
        try:
            return json.loads(self._announcement(slot).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def age_s(self, slot: int) -> float:
        """Seconds since the worker in ``slot`` last beat (0 when there is no file)."""
        try:
            return max(0.0, time.time() - self.path(slot).stat().st_mtime)
        except FileNotFoundError:
            return 0.0

    def start_beating(self, slot: int) -> gevent.Greenlet:
        """In the worker: touch ``slot``'s file every ``BEAT_S`` while the event loop runs."""
        path = self.path(slot)

        def beat() -> None:
            while True:
                try:
                    os.utime(path)
                except OSError:
                    pass  # the master is going away with its directory
                gevent.sleep(BEAT_S)
        return spawn_in_context(beat)

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
