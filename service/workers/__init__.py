"""Pre-forked workers: the master (``master.py``), a worker's side of the fork
(``worker.py``), the group's probe and metrics endpoints the master serves
(``group.py``), the workers' heartbeats and announcements (``heartbeat.py``), and
what both need of the operating system (``process.py``)."""

from service.workers.master import _Master, run_workers

__all__ = ["run_workers", "_Master"]
