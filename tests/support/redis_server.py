"""A real ``redis-server`` (Debian's package) on a free loopback port, for the results cache."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import redis

from service.samples.mongo_server import free_port, stop_process
from tests.support.sockets import wait_for
from tests.support.toolchains import require

__all__ = ["RedisServer", "redis_server"]


class RedisServer:
    """``redis-server`` with no persistence, in a directory of its own; :meth:`pause` and
    :meth:`resume` stop and continue the process (a Redis that is slow to answer)."""

    def __init__(self) -> None:
        require("redis")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="fanout-redis-")
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis.from_url(self.url, socket_timeout=5)
        wait_for(self._answers, 10, "redis-server answering PING")

    def _answers(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """End the server at once (SIGKILL), as a crash would."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        self.resume()
        stop_process(self.process, timeout_s=10)
        self.client.close()
        self._dir.cleanup()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
