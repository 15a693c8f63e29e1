"""How many cores this process may use: its CPU affinity, lowered to its cgroup's CPU quota
(what a container's cpuset and CPU limit allow), for ``server.workers = "auto"``."""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cores", "quota_cores"]

_MAX_CORES = 64
_CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may use, 1..64: its CPU affinity (what a container's cpuset
    allows), lowered to its cgroup's CPU quota rounded up (what a container's CPU limit
    allows, as Kubernetes sets it), so that ``workers = "auto"`` starts no more workers
    than the container can run at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, min(cores, _MAX_CORES))


def quota_cores(quota: str, period: str) -> int | None:
    """Whole cores a CFS quota allows (``ceil(quota / period)``, at least 1); None when
    unlimited (``max``, or -1 in cgroup v1) or unreadable."""
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def _cgroup_quota() -> int | None:
    try:  # cgroup v2: "<quota> <period>" or "max <period>"
        return quota_cores(*(_CGROUP / "cpu.max").read_text().split()[:2])
    except (OSError, TypeError):
        pass
    for folder in ("cpu", "cpu,cpuacct"):  # cgroup v1
        try:
            return quota_cores(
                (_CGROUP / folder / "cpu.cfs_quota_us").read_text(),
                (_CGROUP / folder / "cpu.cfs_period_us").read_text(),
            )
        except OSError:
            continue
    return None
