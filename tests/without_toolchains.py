"""The tests that reach an optional program, run with every such program hidden from PATH.

    python tests/without_toolchains.py [pytest arguments]

A machine with only Python and ``make`` must run ``make test`` to 0 failed and 0 errors,
with one skip line per missing toolchain. CI installs every toolchain, so it would never
see a test that starts a program without the gate (``tests/support/toolchains.py``). This
runs the test files that name a toolchain's program, or a helper that starts one, with a
PATH from which those programs are gone (a folder of links to every other command), and
fails unless pytest passes and its header names each toolchain once as missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.toolchains import TOOLCHAINS  # noqa: E402 (after the path is set)

#: Helpers that start a toolchain's program: a test file using one is run here too.
_STARTERS = ("redis_server", "prometheus", "podman", "ferretdb", "toolchains", "openssl")


def hidden_commands() -> set[str]:
    return {command for toolchain in TOOLCHAINS.values() for command in toolchain.commands}


def shadow_path(hidden: set[str], folder: Path) -> str:
    """A folder of links to every command on PATH but ``hidden`` (the first of each name)."""
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or not os.path.isdir(entry):
            continue
        for name in sorted(os.listdir(entry)):
            target, link = Path(entry) / name, folder / name
            if name in hidden or link.exists() or not os.access(target, os.X_OK):
                continue
            link.symlink_to(target)
    return str(folder)


def test_files() -> list[str]:
    pattern = re.compile(r"\b(" + "|".join(_STARTERS) + r")\b")
    files = [
        path for path in (ROOT / "tests").glob("test_*.py") if pattern.search(path.read_text())
    ]
    interop = ["tests/interop"] if (ROOT / "tests" / "interop").is_dir() else []
    return sorted(str(path.relative_to(ROOT)) for path in files) + interop


def main(args: list[str]) -> int:
    """The files at once, dealt among processes as ``make test`` deals the suite."""
    with tempfile.TemporaryDirectory(prefix="fanout-no-toolchains-") as folder:
        env = {**os.environ, "PATH": shadow_path(hidden_commands(), Path(folder))}
        env.pop("FANOUT_REQUIRE_TOOLCHAINS", None)
        command = [sys.executable, str(ROOT / "tests" / "parallel.py")]
        command += ["--only", ",".join(test_files()), *args]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    named = [
        line.split("'")[1] for line in done.stdout.splitlines() if line.startswith("toolchain '")
    ]
    if sorted(named) != sorted(TOOLCHAINS):
        print(f"without toolchains: the header named {named}, not each of {sorted(TOOLCHAINS)}")
        return 1
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
