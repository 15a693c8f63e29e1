"""Building the generated Apache Thrift clients of ``make interop``.

Each client is generated from ``thrift/appstats.thrift`` by the Apache Thrift
compiler (Debian's ``thrift-compiler``, the ``thrift`` command) and built in
``build/interop/<language>`` with its language's own tools and registry: Go
modules from the Go proxy, libthrift from Maven Central, ``thrift`` from npm.
Versions match the compiler's (0.17.0), as Apache Thrift asks. A missing tool
fails with a message naming what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "IDL",
    "CLIENTS",
    "BUILD_TIMEOUT_S",
    "BuildFailed",
    "build_go",
    "build_java",
    "build_node",
]

ROOT = Path(__file__).resolve().parents[2]
IDL = ROOT / "thrift" / "appstats.thrift"
CLIENTS = Path(__file__).resolve().parent / "clients"
BUILD = ROOT / "build" / "interop"
BUILD_TIMEOUT_S = 600
# Short-lived JVMs (Maven, javac, one client call): the quick compiler alone and the
# serial collector start them on a fraction of the CPU of the defaults.
QUICK_JVM = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


class BuildFailed(RuntimeError):
    """A tool is missing or a build step failed; the message says which and how."""


def _run(command: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    tool = command[0]
    if shutil.which(tool) is None:
        raise BuildFailed(
            f"'{tool}' is not on PATH; `make interop` needs the Apache Thrift "
            "compiler (apt-get install thrift-compiler), Go, Java 17 with Maven, Node"
        )
    done = subprocess.run(
        list(command),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise BuildFailed(
            f"{' '.join(command)} failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return done.stdout


def _fresh(name: str) -> Path:
    where = BUILD / name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True, exist_ok=True)
    return where


def build_go() -> list[str]:
    """The Go client: the command that runs it."""
    where = _fresh("go")
    for name in ("go.mod", "main.go"):
        shutil.copy(CLIENTS / "go" / name, where / name)
    _run(["thrift", "--gen", "go:package_prefix=interop/", "-out", str(where), str(IDL)], where)
    _run(["go", "mod", "tidy"], where)
    _run(["go", "build", "-o", "client", "."], where)
    return [str(where / "client")]


def build_java() -> list[str]:
    """The Java client: the command that runs it."""
    where = _fresh("java")
    (where / "gen").mkdir(exist_ok=True)
    _run(
        [
            "thrift",
            "--gen",
            "java:generated_annotations=suppress",
            "-out",
            str(where / "gen"),
            str(IDL),
        ],
        where,
    )
    classpath_file = where / "classpath.txt"
    _run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(CLIENTS / "java" / "pom.xml"),
            "dependency:build-classpath",
            f"-Dmdep.outputFile={classpath_file}",
        ],
        where,
        env={"MAVEN_OPTS": " ".join(QUICK_JVM)},
    )
    classpath = classpath_file.read_text().strip()
    sources = [str(path) for path in (where / "gen").rglob("*.java")]
    _run(
        [
            "javac",
            *(f"-J{flag}" for flag in QUICK_JVM),
            "-nowarn",
            "-cp",
            classpath,
            "-d",
            str(where / "classes"),
            *sources,
            str(CLIENTS / "java" / "Client.java"),
        ],
        where,
    )
    return ["java", *QUICK_JVM, "-cp", f"{where / 'classes'}{os.pathsep}{classpath}", "Client"]


def build_node() -> list[str]:
    """The Node client: the command that runs it."""
    where = _fresh("node")
    for name in ("package.json", "client.js"):
        shutil.copy(CLIENTS / "node" / name, where / name)
    (where / "gen-nodejs").mkdir(exist_ok=True)
    _run(["thrift", "--gen", "js:node", "-out", str(where / "gen-nodejs"), str(IDL)], where)
    _run(["npm", "install", "--no-audit", "--no-fund", "--silent"], where)
    return ["node", str(where / "client.js")]
