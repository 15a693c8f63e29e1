"""Pre-forked workers: the master (``master.py``), the workers' heartbeats (``heartbeat.py``),
and what both need of the operating system (``process.py``)."""

from service.workers.master import _Master, run_workers
from service.workers.process import LISTEN_BACKLOG, bind_listener

__all__ = ["run_workers", "bind_listener", "LISTEN_BACKLOG", "_Master"]
