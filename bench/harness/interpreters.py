"""Newer CPython interpreters on this machine, and a virtual environment for the server on
each (for the ``python`` scenario, ``pythons.py``): ``python3.N`` on the ``PATH`` above the
running minor version, pyenv's versions, or exactly those in ``FANOUT_BENCH_PYTHONS``."""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["PYTHONS_ENV", "find_newer_pythons", "server_interpreter"]

log = logging.getLogger(__name__)

PYTHONS_ENV = "FANOUT_BENCH_PYTHONS"
_REPO = Path(__file__).resolve().parents[2]
_VENVS = _REPO / "build" / "bench-pythons"
_STAMP = ".fanout-bench-stamp"
_PROBE = "import platform, sys; print(platform.python_implementation(), platform.python_version())"
_INSTALL_TIMEOUT_S = 900


def _probe(path: str) -> tuple[int, ...] | None:
    """The CPython version of the interpreter at ``path``, or None (not CPython, broken)."""
    try:
        shown = subprocess.run(
            [path, "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(shown) != 2 or shown[0] != "CPython":
        return None
    return tuple(int(part) for part in re.findall(r"\d+", shown[1])[:3])


def _candidates() -> list[str]:
    chosen = os.environ.get(PYTHONS_ENV)
    if chosen is not None:
        return [p for p in chosen.split(":") if p]
    found = [shutil.which(f"python3.{minor}") for minor in range(sys.version_info[1] + 1, 20)]
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found += sorted(glob.glob(os.path.join(pyenv_root, "versions", "3.*", "bin", "python3.*")))
    return [p for p in found if p and "/shims/" not in p and re.search(r"python3\.\d+$", p)]


def find_newer_pythons() -> dict[tuple[int, ...], str]:
    """CPython interpreters newer than the running one's minor version, newest patch each,
    by version; exactly ``FANOUT_BENCH_PYTHONS`` when that is set."""
    explicit = PYTHONS_ENV in os.environ
    newest: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = {}
    for path in _candidates():
        version = _probe(path)
        if version is None or (not explicit and version[:2] <= sys.version_info[:2]):
            continue
        if version[:2] not in newest or version > newest[version[:2]][0]:
            newest[version[:2]] = (version, path)
    return {version: path for version, path in sorted(newest.values())}


def _constraints() -> str:
    """``name==version`` for every distribution in the benchmark's environment but the project."""
    pins = {
        f"{d.metadata['Name'].lower()}=={d.version}"
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and d.metadata["Name"].lower() not in ("fanout", "pip", "setuptools")
    }
    return "\n".join(sorted(pins)) + "\n"


def server_interpreter(base: str) -> str:
    """The Python of the virtual environment for the interpreter ``base`` (made if needed).

    Raises ``RuntimeError`` with pip's last lines when the environment cannot be made.
    """
    version = _probe(base)
    if version is None:
        raise RuntimeError(f"{base} is not a working CPython")
    venv = _VENVS / f"cpython-{'.'.join(map(str, version))}"
    python = venv / "bin" / "python"
    constraints = _constraints()
    wanted = hashlib.sha256(
        constraints.encode() + (_REPO / "pyproject.toml").read_bytes()
    ).hexdigest()
    stamp = venv / _STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(python)
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True)
    (venv / "constraints.txt").write_text(constraints)
    log.info("making %s for the python scenario (once)", venv)
    for argv in (
        [base, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(venv / "constraints.txt"),
            "-e",
            str(_REPO),
        ],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"{' '.join(argv[:4])} failed: {tail}")
    stamp.write_text(wanted)
    return str(python)
