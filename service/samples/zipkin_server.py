"""A real Zipkin server on loopback, for ``fanout trace-ui`` and the tests.

The server jar comes from Maven Central (``io.zipkin:zipkin-server``, the ``exec``
jar), checked against the SHA-1 Maven Central publishes beside it, and is cached
under ``$FANOUT_CACHE_DIR`` (default ``~/.cache/fanout``). It needs Java 17 or
newer on ``PATH``; without it :class:`ZipkinUnavailable` says so. Storage is
Zipkin's default, in memory: everything is gone when the process ends.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from service.samples.mongo_server import free_port, stop_process

__all__ = [
    "ZIPKIN_VERSION",
    "ZipkinServer",
    "ZipkinUnavailable",
    "zipkin_jar",
    "java_major_version",
]

ZIPKIN_VERSION = "3.4.2"
_MAVEN = "https://repo1.maven.org/maven2/io/zipkin/zipkin-server"
_MIN_JAVA = 17
_START_TIMEOUT_S = 90.0
# A local trace view serves one person: the JVM's quick compiler alone and its serial
# collector start it on half the CPU of the defaults, which only pay off over hours.
_QUICK_START = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]


class ZipkinUnavailable(RuntimeError):
    """Zipkin cannot run here: no suitable Java, the jar cannot be fetched, or it did not start."""


def java_major_version(java: str = "java") -> int | None:
    """The major version of ``java`` on PATH (17 for "17.0.15"), or None without one."""
    if shutil.which(java) is None:
        return None
    probe = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    found = re.search(r'version "(\d+)(?:\.(\d+))?', probe.stderr + probe.stdout)
    if found is None:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def zipkin_jar(version: str = ZIPKIN_VERSION, cache_dir: Path | None = None) -> Path:
    """The Zipkin server jar, downloaded once from Maven Central and verified by its SHA-1."""
    cache = cache_dir or Path(
        os.environ.get("FANOUT_CACHE_DIR") or Path.home() / ".cache" / "fanout"
    )
    jar = cache / f"zipkin-server-{version}-exec.jar"
    if jar.exists():
        return jar
    cache.mkdir(parents=True, exist_ok=True)
    url = f"{_MAVEN}/{version}/zipkin-server-{version}-exec.jar"
    try:
        with urllib.request.urlopen(url + ".sha1", timeout=60) as answer:
            expected = answer.read().decode().split()[0].strip().lower()
        partial = Path(tempfile.mkstemp(dir=cache, suffix=".part")[1])
        digest = hashlib.sha1()
        with urllib.request.urlopen(url, timeout=120) as answer, partial.open("wb") as out:
            while chunk := answer.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        raise ZipkinUnavailable(f"cannot download {url}: {exc}") from exc
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ZipkinUnavailable(f"{url}: SHA-1 {digest.hexdigest()} does not match {expected}")
    partial.replace(jar)
    return jar


class ZipkinServer:
    """One Zipkin server process on 127.0.0.1, ready once :meth:`start` returns; a context manager.

    ``url`` is its base (``http://127.0.0.1:<port>``); spans go to :attr:`spans_endpoint`.
    """

    def __init__(self, jar: Path | None = None, port: int = 0) -> None:
        self._jar = jar
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None

    @property
    def spans_endpoint(self) -> str:
        return f"{self.url}/api/v2/spans"

    def start(self) -> ZipkinServer:
        """Start Zipkin and wait for its health check. Raises :class:`ZipkinUnavailable`."""
        major = java_major_version()
        if major is None or major < _MIN_JAVA:
            found = "none on PATH" if major is None else f"Java {major}"
            raise ZipkinUnavailable(
                f"Zipkin needs Java {_MIN_JAVA} or newer ({found}); "
                "install a JDK 17, e.g. apt-get install openjdk-17-jre-headless"
            )
        jar = self._jar or zipkin_jar()
        handle, log_name = tempfile.mkstemp(prefix="zipkin-", suffix=".log")
        self._log_path = Path(log_name)
        self._process = subprocess.Popen(
            [
                "java",
                "-Xmx512m",
                *_QUICK_START,
                "-jar",
                str(jar),
                "--armeria.ports[0].ip=127.0.0.1",
                f"--armeria.ports[0].port={self.port}",
                "--armeria.ports[0].protocols=http",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "QUERY_PORT": str(self.port)},
        )
        os.close(handle)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        assert self._process is not None
        until = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < until:
            if self._process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        tail = self._log_tail()
        self.stop()
        raise ZipkinUnavailable(f"Zipkin did not become healthy on {self.url}:\n{tail}")

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 10 s); idempotent."""
        process, self._process = self._process, None
        stop_process(process, timeout_s=10)
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def __enter__(self) -> ZipkinServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
