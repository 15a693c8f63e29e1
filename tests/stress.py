"""``make test-stress``: the whole suite with two CPU-bound processes beside it.

A developer's machine is rarely idle, and CI shares its cores: a test that passes only
when it has the machine to itself fails the first newcomer who runs ``make test`` with a
build going. This runs ``tests/parallel.py`` (what ``make test`` runs after the lint) while
two processes spin on the CPU, each at the normal priority of a build or a browser, so
that every test sees a machine with its cores taken.

Usage: ``python tests/stress.py [--runs N] [-- pytest arguments]``. With ``--runs N`` the
suite runs N times in a row (the hogs stay), stopping at the first failure; one line per
run says how it ended and how long it took. Exit status: the failing run's, else 0.
The hogs end with this process, whatever ends it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOGS = 2
#: A hog spins until its parent (this process) is gone, then ends by itself.
_HOG = (
    "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10**6))\n"
)


def start_hogs(count: int = HOGS) -> list[subprocess.Popen[bytes]]:
    """``count`` CPU-bound processes, each ending when this process ends."""
    return [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(count)]


def stop_hogs(hogs: Sequence[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def run_suite(pytest_args: Sequence[str]) -> int:
    """One ``tests/parallel.py`` run in its own process group; its exit status."""
    suite = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "parallel.py"), *pytest_args],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        return suite.wait()
    except BaseException:
        os.killpg(suite.pid, signal.SIGTERM)
        suite.wait()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs in a row (default 1)")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest process")
    args = parser.parse_args(argv)
    hogs = start_hogs()
    try:
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            status = run_suite(args.pytest_args)
            took = time.monotonic() - started
            verdict = "passed" if status == 0 else f"FAILED (exit {status})"
            print(f"stress run {run}/{args.runs}: {verdict} in {took:.0f} s", flush=True)
            if status:
                return status
        return 0
    finally:
        stop_hogs(hogs)


if __name__ == "__main__":
    sys.exit(main())
