"""A worker's side of the fork: serve on the master's listener until told to stop, then exit.

The worker names itself in the log (its slot), dies with the master, beats its
heartbeat, and serves with :func:`service.lifecycle.run_server`, with settings
that leave the probe and Prometheus ports to the master: its metrics go to a
free loopback port, announced (with its pid) once it serves, for the master's
merged scrape. It never returns into the master's code: it exits with
``run_server``'s code, 2 for a configuration error, 1 for anything else.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import dataclass

from service.config import ConfigError, Settings
from service.logs import set_worker
from service.workers.heartbeat import Heartbeats
from service.workers.process import end_with_master

__all__ = ["WorkerStart", "serve_as_worker", "worker_settings", "CONFIG_ERROR_STATUS"]

log = logging.getLogger(__name__)

#: What ``fanout serve`` and a worker exit with for a configuration error.
CONFIG_ERROR_STATUS = 2


@dataclass(frozen=True)
class WorkerStart:
    """What a newly forked worker is given."""

    settings: Settings
    slot: int
    workers: int
    master_pid: int
    listener: socket.socket
    heartbeats: Heartbeats


def serve_as_worker(start: WorkerStart) -> None:
    """Serve as the worker in ``start.slot``, then exit the process; never returns."""
    code = 1
    try:
        set_worker(str(start.slot))
        end_with_master(start.master_pid)
        from service.lifecycle import run_server

        log.info("worker %d: serving (slot %d of %d)", os.getpid(), start.slot, start.workers)
        start.heartbeats.start_beating(start.slot)
        facts: dict[str, str] = {}
        code = run_server(
            worker_settings(start.settings), listener=start.listener, tune_gc=True,
            on_metrics=lambda at: facts.update(metrics=f"http://{at[0]}:{at[1]}/metrics"),
            on_ready=lambda _: start.heartbeats.announce(start.slot, **facts))
    except Exception as exc:
        log.exception("worker %d failed", os.getpid())
        code = CONFIG_ERROR_STATUS if isinstance(exc, ConfigError) else 1
    finally:
        logging.shutdown()
        os._exit(code)  # never unwind into the master's code in the child


def worker_settings(settings: Settings) -> Settings:
    """A worker's settings: the master serves the probe port and the Prometheus port, so a
    worker serves no probes and its metrics on a free loopback port (which it announces)."""
    return dataclasses.replace(
        settings, server=dataclasses.replace(settings.server, probe_port=-1),
        metrics=dataclasses.replace(settings.metrics, host="127.0.0.1", port=0))
