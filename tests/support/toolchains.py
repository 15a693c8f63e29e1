"""The toolchains some tests need beyond Python, and what to do when one is missing.

    pytestmark = needs("interop")

On a machine with only Python and ``make``, a test needing a missing toolchain
is skipped, and the session's header says once per toolchain what is missing and
how to install it. With ``FANOUT_REQUIRE_TOOLCHAINS=1`` (as ``.ci/run`` sets) a
missing toolchain is an error before any test runs, so CI never skips them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest

__all__ = ["REQUIRE_ENV", "Toolchain", "TOOLCHAINS", "missing", "needs", "header_lines",
           "check_required"]

#: Set to 1 to make a missing toolchain an error (CI).
REQUIRE_ENV = "FANOUT_REQUIRE_TOOLCHAINS"


@dataclass(frozen=True)
class Toolchain:
    """Commands a group of tests runs, and how to get them."""

    name: str
    commands: tuple[str, ...]
    tests: str
    install: str


TOOLCHAINS = {toolchain.name: toolchain for toolchain in (
    Toolchain("interop", ("thrift", "go", "javac", "java", "mvn", "node", "npm"),
              "the generated Go, Java and Node clients (tests/interop)",
              "the Apache Thrift compiler (thrift-compiler; `make toolchains` as root installs "
              "it), Go, Java 17 with Maven, Node with npm"),
    Toolchain("zipkin", ("java",), "the Zipkin trace view (tests/test_trace_ui.py)", "Java 17"),
    Toolchain("image", ("podman", "mmdebstrap", "runc"),
              "the container image (tests/test_image.py)",
              "podman, mmdebstrap and runc (`make toolchains` as root installs them)"),
)}


def missing(name: str) -> list[str]:
    """The commands of toolchain ``name`` that are not on PATH."""
    return [command for command in TOOLCHAINS[name].commands if shutil.which(command) is None]


def _reason(name: str) -> str:
    toolchain = TOOLCHAINS[name]
    return (f"toolchain '{name}' missing ({', '.join(missing(name))} not on PATH): "
            f"skipping {toolchain.tests}; install {toolchain.install}")


def needs(name: str) -> pytest.MarkDecorator:
    """A mark skipping the test (or module) when toolchain ``name`` is incomplete."""
    return pytest.mark.skipif(bool(missing(name)), reason=_reason(name) if missing(name) else "")


def header_lines() -> list[str]:
    """One line per missing toolchain, for the session's header."""
    return [_reason(name) for name in TOOLCHAINS if missing(name)]


def check_required() -> None:
    """Under ``FANOUT_REQUIRE_TOOLCHAINS=1``, refuse to run with a toolchain missing."""
    if os.environ.get(REQUIRE_ENV) == "1" and (lines := header_lines()):
        raise pytest.UsageError(f"{REQUIRE_ENV}=1 and " + "; ".join(lines))
