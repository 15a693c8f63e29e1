"""The tutorial's steps, read from its page and run as a reader runs them.

``docs/tutorial/index.md`` is read block by block, in order:

- a ``toml`` block titled with a file name is written to that file;
- a ``sh`` block titled ``terminal N (keeps running)`` starts a server: its one command
  runs in the background (a server already running in terminal N is stopped first, as
  the page tells the reader to), and the step is done once it has printed a line;
- any other ``sh`` block runs line by line, each line a command that must exit 0.

Everything runs in a folder of its own beside a link to the checkout's ``.venv``; a
``make`` target runs in the checkout (``make -C``). The page's ports are swapped for free
ones, the same everywhere, so that the run never meets a port in use. Each ``fanout call``
gets a deadline of ``CALL_BUDGET_MS`` instead of the default 2 s, so that the page's
answers do not depend on how busy the machine is.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from service.samples.mongo_server import free_port

__all__ = ["Step", "steps", "Tutorial", "CALL_BUDGET_MS"]

#: The deadline of the page's ``fanout call`` commands, and the servers' deadline.
CALL_BUDGET_MS = 10_000

_BLOCK = re.compile(r'^```(\w+)(?: title="([^"]*)")?\n(.*?)^```', re.M | re.S)
_HEADING = re.compile(r"^## (.+)$", re.M)
_TERMINAL = re.compile(r"terminal (\d+) \(keeps running\)")
_PORT = re.compile(r"(?<![\d.])(\d{4,5})(?!\d)")


@dataclass(frozen=True)
class Step:
    """One block of the page: ``kind`` is ``file``, ``server`` or ``commands``."""

    kind: str
    text: str
    name: str = ""  # the file's name, or the server's terminal
    section: str = ""  # the heading above it ("4. Optional: ...")


def steps(page: str) -> Iterator[Step]:
    """The page's runnable blocks, in order."""
    headings = [(m.start(), m.group(1)) for m in _HEADING.finditer(page)]
    for match in _BLOCK.finditer(page):
        language, title, body = match.group(1), match.group(2) or "", match.group(3)
        section = next((text for at, text in reversed(headings) if at < match.start()), "")
        if language == "toml" and title:
            yield Step("file", body, title, section)
        elif language == "sh" and (terminal := _TERMINAL.search(title)):
            yield Step("server", body.strip(), terminal.group(1), section)
        elif language == "sh":
            yield Step("commands", body, section=section)


@dataclass
class Tutorial:
    """Runs the steps in ``workdir``; :meth:`close` stops every server it started."""

    root: Path
    workdir: Path
    ports: dict[str, str] = field(default_factory=dict)
    servers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    outputs: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.workdir / ".venv").symlink_to(self.root / ".venv")
        # A panel's default budget is half the client's default deadline of 2 s; on a
        # starved machine (the suite beside two CPU hogs) the sample backends' first
        # aggregations can take longer than the whole deadline, and the page's output
        # would then differ for a reason the page is not about. So every call gets
        # CALL_BUDGET_MS (`_with_budget`), and the servers' deadline and panels follow.
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "FANOUT_FANOUT_REQUEST_DEADLINE_MS": str(CALL_BUDGET_MS),
            "FANOUT_FANOUT_TASK_TIMEOUT_MS": str(CALL_BUDGET_MS - 500),
        }

    def with_free_ports(self, text: str, page_ports: set[str]) -> str:
        def swap(match: re.Match[str]) -> str:
            port = match.group(1)
            if port not in page_ports:
                return port
            return self.ports.setdefault(port, str(free_port()))

        return _PORT.sub(swap, text)

    def run(self, step: Step, timeout_s: float) -> None:
        if step.kind == "file":
            (self.workdir / step.name).write_text(step.text)
        elif step.kind == "server":
            self._start(step, timeout_s)
        else:
            for line in step.text.strip().splitlines():
                self.outputs.append((line, self._command(line, timeout_s)))

    def _command(self, line: str, timeout_s: float) -> str:
        line = _with_budget(self._in_checkout(line))
        done = subprocess.run(
            line,
            shell=True,
            cwd=self.workdir,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, (
            f"`{line}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
        return done.stdout

    def _start(self, step: Step, timeout_s: float) -> None:
        self._stop(step.name)
        log = self.workdir / f"terminal-{step.name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                self._in_checkout(step.text),
                shell=True,
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers[step.name] = process
        deadline = time.monotonic() + timeout_s
        while not log.read_text(errors="replace").strip():
            assert process.poll() is None, (
                f"`{step.text}` exited {process.returncode}:\n{log.read_text(errors='replace')}"
            )
            assert time.monotonic() < deadline, f"`{step.text}` printed nothing in {timeout_s} s"
            time.sleep(0.2)
        if "fanout serve" in step.text:  # its first line is `serving on` once it serves
            while "serving on" not in log.read_text(errors="replace"):
                assert process.poll() is None and time.monotonic() < deadline, log.read_text(
                    errors="replace"
                )
                time.sleep(0.2)

    def _in_checkout(self, line: str) -> str:
        return re.sub(r"^make ", f"make -C {self.root} ", line)

    def _stop(self, name: str, timeout_s: float = 60.0) -> None:
        process = self.servers.pop(name, None)
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in its terminal
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        for name in list(self.servers):
            self._stop(name)


def _with_budget(line: str) -> str:
    """``line`` with ``--deadline-ms CALL_BUDGET_MS`` when it is a ``fanout call`` naming none."""
    if re.search(r"\bfanout call\b", line) and "--deadline-ms" not in line:
        return f"{line} --deadline-ms {CALL_BUDGET_MS}"
    return line
