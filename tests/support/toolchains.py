"""The toolchains some tests need beyond Python, and what to do when one is missing.

    pytestmark = needs("interop")

On a machine with only Python and ``make``, a test needing a missing toolchain
is skipped, and the session's header says once per toolchain what is missing and
how to install it. With ``FANOUT_REQUIRE_TOOLCHAINS=1`` (as ``.ci/run`` sets) a
missing toolchain is an error before any test runs, so CI never skips them;
``FANOUT_REQUIRE_TOOLCHAINS=compat`` (a comma-separated list) requires only those.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "REQUIRE_ENV",
    "PG_BIN",
    "PG_EXTENSIONS",
    "FERRETDB",
    "Toolchain",
    "TOOLCHAINS",
    "missing",
    "needs",
    "require",
    "header_lines",
    "required",
    "check_required",
]

#: Set to 1 to make a missing toolchain an error (CI).
REQUIRE_ENV = "FANOUT_REQUIRE_TOOLCHAINS"
#: Debian's PostgreSQL 15, which ``make compat`` builds DocumentDB for.
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_EXTENSIONS = Path("/usr/share/postgresql/15/extension")
#: Where ``make compat`` leaves the FerretDB binary.
FERRETDB = Path(__file__).resolve().parents[2] / "build" / "compat" / "bin" / "ferretdb"


@dataclass(frozen=True)
class Toolchain:
    """Commands a group of tests runs, and how to get them."""

    name: str
    commands: tuple[str, ...]
    tests: str
    install: str
    #: Files that must exist besides the commands (what a make target builds).
    files: tuple[Path, ...] = ()


TOOLCHAINS = {
    toolchain.name: toolchain
    for toolchain in (
        Toolchain(
            "interop",
            ("thrift", "go", "javac", "java", "mvn", "node", "npm"),
            "the generated Go, Java and Node clients (tests/interop)",
            "the Apache Thrift compiler (thrift-compiler; `make toolchains` as root installs "
            "it), Go, Java 17 with Maven, Node with npm",
        ),
        Toolchain("zipkin", ("java",), "the Zipkin trace view (tests/test_trace_ui.py)", "Java 17"),
        Toolchain(
            "image",
            ("podman", "mmdebstrap", "runc"),
            "the container image (tests/test_image.py)",
            "podman, mmdebstrap and runc (`make toolchains` as root installs them)",
        ),
        Toolchain(
            "redis",
            ("redis-server",),
            "the results cache shared in Redis (tests/test_results_cache.py)",
            "Debian's redis-server (`make toolchains` as root installs it)",
        ),
        Toolchain(
            "prometheus",
            ("promtool", "prometheus"),
            "the alerting rules and their unit tests (tests/test_monitoring.py)",
            "Debian's prometheus, which brings promtool (`make toolchains` as root installs it)",
        ),
        Toolchain(
            "openssl",
            ("openssl",),
            "the certificates' dates as openssl reads them (tests/test_mutual_tls.py)",
            "OpenSSL's command (Debian's openssl)",
        ),
        Toolchain(
            "compat",
            ("runuser",) if os.geteuid() == 0 else (),
            "FerretDB 2 on PostgreSQL with DocumentDB (tests/test_compat.py)",
            "the engine with `make compat` (root, for Debian's PostgreSQL 15 packages)",
            files=(PG_BIN / "postgres", PG_EXTENSIONS / "documentdb.control", FERRETDB),
        ),
    )
}


def missing(name: str) -> list[str]:
    """The commands of toolchain ``name`` not on PATH, and its files that do not exist."""
    toolchain = TOOLCHAINS[name]
    return [
        f"{command} not on PATH" for command in toolchain.commands if shutil.which(command) is None
    ] + [f"no {path}" for path in toolchain.files if not path.exists()]


def _reason(name: str) -> str:
    toolchain = TOOLCHAINS[name]
    return (
        f"toolchain '{name}' missing ({', '.join(missing(name))}): "
        f"skipping {toolchain.tests}; install {toolchain.install}"
    )


def needs(name: str) -> pytest.MarkDecorator:
    """A mark skipping the test (or module) when toolchain ``name`` is incomplete."""
    return pytest.mark.skipif(bool(missing(name)), reason=_reason(name) if missing(name) else "")


def require(name: str) -> None:
    """Skip the test at hand unless toolchain ``name`` is complete.

    Every fixture and helper that starts one of the toolchains' programs calls it first,
    so a test reaching the program through them cannot forget the check; with
    ``FANOUT_REQUIRE_TOOLCHAINS`` the session has refused to start already.
    """
    if missing(name):
        pytest.skip(_reason(name))


def header_lines() -> list[str]:
    """One line per missing toolchain, for the session's header."""
    return [_reason(name) for name in TOOLCHAINS if missing(name)]


def required() -> list[str]:
    """The toolchains ``FANOUT_REQUIRE_TOOLCHAINS`` requires: ``1`` all, else those it names."""
    value = os.environ.get(REQUIRE_ENV, "")
    if value in ("", "0"):
        return []
    names = list(TOOLCHAINS) if value == "1" else [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in names if n not in TOOLCHAINS]:
        raise pytest.UsageError(
            f"{REQUIRE_ENV}={value}: unknown toolchain {', '.join(unknown)} "
            f"(known: 1, or any of {', '.join(TOOLCHAINS)})"
        )
    return names


def check_required() -> None:
    """Refuse to run with a toolchain missing that ``FANOUT_REQUIRE_TOOLCHAINS`` requires."""
    if lines := [_reason(name) for name in required() if missing(name)]:
        raise pytest.UsageError(f"{REQUIRE_ENV}={os.environ[REQUIRE_ENV]} and " + "; ".join(lines))
