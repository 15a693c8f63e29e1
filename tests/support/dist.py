"""Pytest plugin: Fanout as it ships, built from this checkout and installed elsewhere.

Session-scoped: ``dist`` builds the sdist, and the wheel from that sdist, with
``python -m build`` (what a release runs); ``installed`` is that wheel, with its
``demo`` extra, in a fresh venv outside the checkout. Commands run there from a
directory outside the checkout with no ``PYTHONPATH``, so nothing of the source
tree can stand in for what the wheel lacks.

Under ``make test`` (tests/parallel.py) the processes share one build: the first to
need it builds into ``$FANOUT_TEST_SHARED/dist`` while holding a lock there, and the
others wait for it and take the same files. Both the build's isolated environments and
the installed venv are filled by uv, which installs the same wheels as pip in a
fraction of the time; pip itself installs the wheel in the image build (test_image).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["ROOT", "Dist", "Installed", "dist", "fresh_install", "installed"]

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
        base = {
            key: value
            for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        }
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", **(extra or {})}

    def run(
        self, command: Sequence[str], timeout_s: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(command),
            cwd=self.outside,
            env=self.env(env),
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )

    def popen(
        self, command: Sequence[str], env: dict[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            list(command), cwd=self.outside, env=self.env(env), text=True, **kwargs
        )  # type: ignore[call-overload]


def _check(command: Sequence[str], cwd: Path, timeout_s: float = _BUILD_TIMEOUT_S) -> None:
    done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (
        f"{' '.join(map(str, command))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


def _source_tree(into: Path) -> Path:
    """A copy of the files a release is built from: git's, untracked ones included.

    Building in the checkout itself would read its stale ``*.egg-info``, whose
    file list can put into the wheel what the package configuration leaves out.
    """
    if (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        for name in filter(None, listed.split("\0")):
            if (ROOT / name).is_file():
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, into / name)
    else:  # an unpacked sdist
        shutil.copytree(
            ROOT,
            into,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".venv", "build", "*.egg-info", "__pycache__"),
        )
    return into


def _uv() -> str:
    """uv, from the test environment (the ``test`` extra installs it beside this Python)."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.exists() else shutil.which("uv") or "uv"


def _build(out: Path, scratch: Path) -> Dist:
    """The sdist and wheel in ``out``, built once: an earlier build found there is reused."""
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    if not (wheels and sdists):
        source = _source_tree(scratch)
        path = f"{Path(_uv()).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        _check(
            [
                "env",
                f"PATH={path}",
                sys.executable,
                "-m",
                "build",
                "--installer",
                "uv",
                "--outdir",
                str(out),
                str(source),
            ],
            source,
        )
        wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return Dist(wheels[0], sdists[0])


class _Lock:
    """An exclusive lock on a directory (its ``.lock`` file), waited for without
    blocking the gevent hub."""

    def __init__(self, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self._file = (where / ".lock").open("a")

    def __enter__(self) -> None:
        deadline = time.monotonic() + _BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"another process held {self._file.name}"
                time.sleep(0.2)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    scratch = tmp_path_factory.mktemp("source")
    if shared := os.environ.get("FANOUT_TEST_SHARED"):
        out = Path(shared) / "dist"
        with _Lock(out):
            return _build(out, scratch)
    return _build(tmp_path_factory.mktemp("dist"), scratch)


def fresh_install(where: Path, requirement: str, env: dict[str, str] | None = None) -> Installed:
    """``requirement`` (a wheel, or an sdist built on the way) in a new venv under ``where``.

    ``env`` is added to the installer's environment (``CC`` for an sdist's build). An sdist
    is always built afresh, never taken from the installer's cache of earlier builds."""
    venv, outside = where / "venv", where / "work"
    outside.mkdir(parents=True)
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)], outside)
    fresh = ["--reinstall-package", "fanout", "--refresh-package", "fanout"]
    _check(
        [
            "env",
            *(f"{key}={value}" for key, value in (env or {}).items()),
            _uv(),
            "pip",
            "install",
            "--quiet",
            "--compile-bytecode",  # as pip installs: compiled once, not at each start
            *(fresh if requirement.endswith(".tar.gz") else []),
            "--python",
            str(venv / "bin" / "python"),
            requirement,
        ],
        outside,
    )
    return Installed(venv, outside)


@pytest.fixture(scope="session")
def installed(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return fresh_install(tmp_path_factory.mktemp("installed"), f"{dist.wheel}[demo]")
