"""Pytest plugin: Fanout as it ships, built from this checkout and installed elsewhere.

Session-scoped: ``dist`` builds the sdist, and the wheel from that sdist, with
``python -m build`` (what a release runs); ``installed`` is that wheel, with its
``demo`` extra, in a fresh venv outside the checkout. Commands run there from a
directory outside the checkout with no ``PYTHONPATH``, so nothing of the source
tree can stand in for what the wheel lacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest

__all__ = ["ROOT", "Dist", "Installed", "dist", "installed"]

ROOT = Path(__file__).resolve().parents[2]
_BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Dist:
    """What ``python -m build`` made."""

    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class Installed:
    """A venv holding only the built wheel and its dependencies."""

    venv: Path
    outside: Path  # a working directory outside the checkout

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a user's shell gives: the venv's bin first, no PYTHONPATH."""
        base = {key: value for key, value in os.environ.items()
                if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", **(extra or {})}

    def run(self, command: Sequence[str], timeout_s: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(command), cwd=self.outside, env=self.env(env), text=True,
                              capture_output=True, timeout=timeout_s)

    def popen(self, command: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        return subprocess.Popen(list(command), cwd=self.outside, env=self.env(env), text=True,
                                **kwargs)  # type: ignore[call-overload]


def _check(command: Sequence[str], cwd: Path, timeout_s: float = _BUILD_TIMEOUT_S) -> None:
    done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _source_tree(into: Path) -> Path:
    """A copy of the files a release is built from: git's, untracked ones included.

    Building in the checkout itself would read its stale ``*.egg-info``, whose
    file list can put into the wheel what the package configuration leaves out.
    """
    if (ROOT / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode()
        for name in filter(None, listed.split("\0")):
            if (ROOT / name).is_file():
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, into / name)
    else:  # an unpacked sdist
        shutil.copytree(ROOT, into, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", "build", "*.egg-info", "__pycache__"))
    return into


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    source = _source_tree(tmp_path_factory.mktemp("source"))
    _check([sys.executable, "-m", "build", "--outdir", str(out), str(source)], source)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return Dist(wheels[0], sdists[0])


@pytest.fixture(scope="session")
def installed(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    where = tmp_path_factory.mktemp("installed")
    venv, outside = where / "venv", where / "work"
    outside.mkdir()
    _check([sys.executable, "-m", "venv", str(venv)], outside)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    # The resolver of older pips (23.x) finds no set of the OpenTelemetry packages.
    _check([*pip, "install", "--upgrade", "pip"], outside)
    _check([*pip, "install", f"{dist.wheel}[demo]"], outside)
    yield Installed(venv, outside)
