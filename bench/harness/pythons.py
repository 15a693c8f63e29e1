"""The ``python`` scenario: the same server on each CPython found on the machine.

Tests and every other scenario run on the interpreter the benchmark runs on (the
project's minimum). This scenario also serves from each newer CPython it finds:

- ``python3.N`` on the ``PATH`` for N above the running minor version;
- pyenv's versions (``$PYENV_ROOT``, else ``~/.pyenv``), not its shims;
- or exactly the interpreters in ``FANOUT_BENCH_PYTHONS`` (``:``-separated paths).

Only the server runs on the other interpreter; the backends and the load generator
stay on the benchmark's, so a ratio compares the server alone. Each interpreter gets
a virtual environment in ``build/bench-pythons/cpython-X.Y.Z`` holding this project
(editable) and the very versions of its dependencies the benchmark's own environment
has (as pip constraints), made once and remade when ``pyproject.toml`` or those
versions change. An interpreter whose environment cannot be made is reported as an
ERROR row, and the others still run.
"""

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
from typing import TYPE_CHECKING, Any, Optional

from bench.analysis.goals import Goal, info_row, ratio_goal

if TYPE_CHECKING:
    from bench.harness.scenarios import Scale, Scenario

__all__ = ["PYTHONS_ENV", "find_newer_pythons", "server_interpreter", "python_versions"]

log = logging.getLogger(__name__)

PYTHONS_ENV = "FANOUT_BENCH_PYTHONS"
CONNECTIONS = 20
_REPO = Path(__file__).resolve().parents[2]
_VENVS = _REPO / "build" / "bench-pythons"
_STAMP = ".fanout-bench-stamp"
_PROBE = "import platform, sys; print(platform.python_implementation(), platform.python_version())"
_INSTALL_TIMEOUT_S = 900


def _probe(path: str) -> Optional[tuple[int, ...]]:
    """The CPython version of the interpreter at ``path``, or None (not CPython, broken)."""
    try:
        shown = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
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
    pins = {f"{d.metadata['Name'].lower()}=={d.version}" for d in importlib.metadata.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower() not in ("fanout", "pip", "setuptools")}
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
    wanted = hashlib.sha256(constraints.encode() + (_REPO / "pyproject.toml").read_bytes()).hexdigest()
    stamp = venv / _STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(python)
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True)
    (venv / "constraints.txt").write_text(constraints)
    log.info("making %s for the python scenario (once)", venv)
    for argv in ([base, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                 [str(python), "-m", "pip", "install", "--quiet", "-c", str(venv / "constraints.txt"),
                  "-e", str(_REPO)]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"{' '.join(argv[:4])} failed: {tail}")
    stamp.write_text(wanted)
    return str(python)


def _label(version: tuple[int, ...]) -> str:
    return "cpython-" + ".".join(map(str, version))


def python_versions(scale: "Scale") -> "Scenario":
    # Imported here: bench.harness.scenarios registers this scenario, so it imports this module.
    from bench.harness.scenarios import Scenario, _config, _cpu_ms_per_reply, _per_rep

    name = "python"
    minimum = _label(tuple(sys.version_info[:3]))
    newer = find_newer_pythons()
    configs = [_config(name, "fanout", "stats", CONNECTIONS, label=minimum)]
    configs += [_config(name, "fanout", "stats", CONNECTIONS, label=_label(v), python=path)
                for v, path in newer.items()]

    def goals(results: dict[str, dict[str, Any]]) -> list[Goal]:
        base = results.get(f"{name}/{minimum}/c{CONNECTIONS}")
        out: list[Goal] = []
        for version in newer:
            other = results.get(f"{name}/{_label(version)}/c{CONNECTIONS}")
            if other and other.get("error"):
                out.append(Goal(name, f"{_label(version)}: could not serve", "ERROR", "n/a",
                                note=other["error"][:300]))
                continue
            out.append(ratio_goal(name, f"server CPU per call, {_label(version)} / {minimum}",
                                  _cpu_ms_per_reply(other), _cpu_ms_per_reply(base),
                                  limit=None, at_most=True))
            out.append(ratio_goal(name, f"calls/s, {_label(version)} / {minimum}",
                                  _per_rep(other, "rps"), _per_rep(base, "rps"),
                                  limit=None, at_most=False))
        if not newer:
            out.append(info_row(name, "newer CPython found", "none",
                                note=f"looked on PATH and in pyenv; set {PYTHONS_ENV} to choose"))
        return out

    notes = [f"Closed loop of get_app_stats at {CONNECTIONS} connections (20 ms backends, tracing "
             f"off), the server on each CPython found ({minimum} is the interpreter the benchmark "
             "and the tests run on); the backends and load generator stay on that one. Each "
             "other interpreter serves from build/bench-pythons/, with the same dependency "
             "versions."]
    return Scenario(name, "Python versions", configs, goals, notes)
