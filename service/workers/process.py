"""What the master and its workers need of the operating system: dying with the master,
and signal names for the log."""

from __future__ import annotations

import os
import signal

__all__ = ["end_with_master", "signal_name", "CONFIG_ERROR_STATUS"]

#: What ``fanout serve`` and a worker exit with for a configuration error.
CONFIG_ERROR_STATUS = 2

_PR_SET_PDEATHSIG = 1


def end_with_master(master_pid: int) -> None:
    """Have the kernel send this worker SIGTERM if the master dies (Linux), so none is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: a killed master leaves its workers to be stopped by hand
    if os.getppid() != master_pid:  # the master died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
