"""A worker process: ``python -m service.workers.worker FD``, started by the master.

The master starts each worker as a new program (fork and exec), not as a fork of
itself, so a worker holds no descriptor of the master's: not its probe or
metrics listeners, not a connection one of them accepted, not its backend
clients. Python opens every descriptor close-on-exec; only the control line
(``FD``, :mod:`service.workers.control`) is passed on. Over it comes the
``start`` message: the settings as the master loaded them, the position, where the
heartbeats go, and the shared Thrift listener as a descriptor.

The worker names itself in the log (its position), dies with the master, beats its
heartbeat, keeps its calls where the master counts them should it die without a word, and
serves with :func:`service.workers.lifecycle.run_server`, with settings
that leave the probe and Prometheus ports to the master: its metrics go to a
free loopback port, announced (with its pid) once it serves, for the master's
merged scrape. What the master says on the line (:class:`GroupMember`) moves
connections in and out, and feeds it the group's backend checks and pools. It
exits with ``run_server``'s code, 2 for a configuration error, 1 for anything else.
"""

# The worker is a program of its own: patch before anything imports socket or ssl.
from service.patching import patch_all

patch_all()

import dataclasses
import logging
import os
import socket
import sys
from typing import Any

from service.operations.logs import configure_logging, set_worker
from service.settings.config import ConfigError, Settings
from service.workers.control import ControlLine
from service.workers.heartbeat import Heartbeats
from service.workers.member import GroupMember
from service.workers.process import CONFIG_ERROR_STATUS, end_with_master
from tracing.call_tally import keep_calls_in

__all__ = ["main", "worker_settings"]

log = logging.getLogger("service.workers.worker")  # run as __main__


def main(argv: list[str] | None = None) -> int:
    """Receive the start message on the control line named by ``argv[0]``, then serve."""
    line = ControlLine.from_fd(int((argv or sys.argv[1:])[0]))
    received = line.receive()
    if received is None or received[1] is None:
        return 1  # the master went away before the worker could start
    start, listener_fd = received
    listener = socket.socket(fileno=listener_fd)
    settings: Settings = start["settings"]
    configure_logging(settings.logging, start["log_level"])
    set_worker(str(start["position"]))
    return serve_as_worker(settings, start, listener, line)


def serve_as_worker(
    settings: Settings, start: dict[str, Any], listener: socket.socket, line: ControlLine
) -> int:
    """Serve as the worker in ``start["position"]`` until told to stop; the exit code."""
    from service.workers.lifecycle import run_server

    position = start["position"]
    try:
        end_with_master(start["master_pid"])
        log.info("worker %d: serving (position %d of %d)", os.getpid(), position, start["workers"])
        heartbeats = Heartbeats(start["heartbeats"])
        heartbeats.start_beating(start["serial"])
        keep_calls_in(heartbeats.calls_path(start["serial"]))  # before the server is built
        member = GroupMember(line, position)
        facts: dict[str, str] = {}
        return run_server(
            worker_settings(settings),
            listener=listener,
            tune_gc=True,
            stop=member.stop,
            on_metrics=lambda at: facts.update(metrics=f"http://{at[0]}:{at[1]}/metrics"),
            on_service=member.attach,
            on_drained=member.last_counts,
            on_ready=lambda _: heartbeats.announce(start["serial"], **facts),
        )
    except ConfigError:
        log.exception("worker %d: configuration error", os.getpid())
        return CONFIG_ERROR_STATUS
    except Exception:
        log.exception("worker %d failed", os.getpid())
        return 1


def worker_settings(settings: Settings) -> Settings:
    """A worker's settings: the master serves the probe port and the Prometheus port, so a
    worker serves no probes and its metrics on a free loopback port (which it announces)."""
    return dataclasses.replace(
        settings,
        server=dataclasses.replace(settings.server, probe_port=-1),
        metrics=dataclasses.replace(settings.metrics, host="127.0.0.1", port=0),
    )


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.exit(code)
