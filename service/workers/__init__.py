"""Pre-forked workers: the master (``master.py``), the group's probe and metrics
endpoints it serves (``group.py``), the workers' heartbeats and announcements
(``heartbeat.py``), and what both need of the operating system (``process.py``)."""

from service.workers.master import _Master, run_workers

__all__ = ["run_workers", "_Master"]
