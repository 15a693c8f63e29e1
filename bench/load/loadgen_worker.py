"""One load-generator process: a gevent loop driving many connections.

Run as ``python -m bench.load.loadgen_worker`` by :mod:`bench.load.loadgen`, never by hand.

Speaks JSON lines with :mod:`bench.load.loadgen` over stdin/stdout:

1. reads the plan (one line), opens its connections (at most ``connect_concurrency``
   connecting at once, so the server's backlog is not flooded) and writes
   ``{"event": "ready", ...}``;
2. reads ``{"go": T0}`` (T0 on the system-wide monotonic clock, shared by every
   process), calls until ``T0 + warmup_s + reps * window_s`` and writes
   ``{"event": "result", ...}``.

Each connection calls back-to-back (closed loop) or, when ``interval_s`` > 0, once per
interval from a random phase. A call is the pre-encoded frame sent whole, then one
reply read and classified by :func:`bench.load.frames.classify_reply`; its latency is
counted in the window in which it completed. A failed connection is replaced by a
new one; the failure is counted by kind.
"""

from __future__ import annotations

import base64
import json
import os
import random
import resource
import socket as stdlib_socket
import struct
import sys
import time
from array import array
from typing import Any

import gevent
import gevent.socket
from gevent.lock import Semaphore

from bench.load.frames import MONITOR_CUT_BYTES, classify_reply, decode_result, exception_names

__all__ = ["main"]

_RECV_BYTES = 65536
_END_GRACE_S = 0.5  # after the last window, before calls still in flight are dropped


class _Recorder:
    """Counts and latencies per measured window and per frame."""

    def __init__(self, plan: dict[str, Any], frames: int) -> None:
        self.reps = plan["reps"]
        self.window_s = plan["window_s"]
        self.measure_start = 0.0
        self.ok = [[0] * frames for _ in range(self.reps)]
        self.degraded = [[0] * frames for _ in range(self.reps)]
        self.failures: list[dict[str, int]] = [{} for _ in range(self.reps)]
        self.latencies = [[array("d") for _ in range(frames)] for _ in range(self.reps)]
        self.outside_failures: dict[str, int] = {}
        self.samples: list[dict[str, Any]] = []
        self.monitor_cut = 0  # replies with a panel failed by pymongo's monitor, whenever

    def window(self, now: float) -> int:
        """The measured window ``now`` falls in, or -1 (warm-up or after the end)."""
        index = int((now - self.measure_start) // self.window_s)
        return index if 0 <= index < self.reps and now >= self.measure_start else -1

    def fail(self, now: float, kind: str) -> None:
        w = self.window(now)
        bucket = self.failures[w] if w >= 0 else self.outside_failures
        bucket[kind] = bucket.get(kind, 0) + 1


def _exchange(sock: Any, frame: bytes) -> bytes:
    """Send one call and return its reply message without the 4-byte frame header."""
    sock.sendall(frame)
    data: bytes = sock.recv(_RECV_BYTES)
    while len(data) < 4:
        more = sock.recv(_RECV_BYTES)
        if not more:
            raise EOFError("connection closed by the server")
        data += more
    (length,) = struct.unpack_from("!i", data, 0)
    if length < 0:
        raise EOFError("negative frame length")
    need = length + 4
    if len(data) < need:
        chunks, have = [data], len(data)
        while have < need:
            more = sock.recv(max(_RECV_BYTES, need - have))
            if not more:
                raise EOFError("connection closed by the server")
            chunks.append(more)
            have += len(more)
        data = b"".join(chunks)
    return data[4:need]


def _connect(plan: dict[str, Any]) -> Any:
    sock = gevent.socket.create_connection(
        (plan["host"], plan["port"]), timeout=plan["connect_timeout_s"]
    )
    sock.setsockopt(stdlib_socket.IPPROTO_TCP, stdlib_socket.TCP_NODELAY, 1)
    sock.settimeout(plan["call_timeout_s"])
    return sock


def _retry_after_s(method: str, body: bytes) -> float:
    """The jittered wait an Overloaded reply asks for (0.1 s if it names none)."""
    try:
        retry_after_ms = decode_result(method, body).overloaded.retry_after_ms or 100
    except Exception:  # a reply we cannot decode: back off a little all the same
        retry_after_ms = 100
    return retry_after_ms / 1000.0 * random.uniform(0.5, 1.5)


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, stdlib_socket.timeout)):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connect_refused"
    return "transport"


class _Caller:
    """One connection's calling loop."""

    def __init__(
        self,
        index: int,
        plan: dict[str, Any],
        frames: list[bytes],
        recorder: _Recorder,
        sock: Any | None,
    ) -> None:
        self.frame_index = (plan["conn_offset"] + index) % len(frames)
        self.frame = frames[self.frame_index]
        self.plan = plan
        self.recorder = recorder
        self.sock = sock
        self.exceptions = exception_names(plan["method"])
        self.resume_at = 0.0  # after an Overloaded: when to call again (honour_retry_after)

    def run(self, start_at: float, end_at: float, phase_s: float) -> None:
        interval = self.plan["interval_s"]
        open_loop = interval > 0 and self.plan.get("open_loop", False)
        next_at = start_at + phase_s
        while True:
            now = time.monotonic()
            scheduled = None
            if interval > 0:
                if next_at >= end_at:
                    break
                if next_at > now:
                    gevent.sleep(next_at - now)
                if open_loop:  # keep the schedule; a late call's latency counts from it
                    scheduled, next_at = next_at, next_at + interval
                else:
                    next_at = max(next_at + interval, time.monotonic())
            elif now >= end_at:
                break
            if self.resume_at > now:
                gevent.sleep(min(self.resume_at, end_at) - now)
                continue
            self.call_once(scheduled)
        if self.sock is not None:
            self.sock.close()

    def call_once(self, scheduled: float | None = None) -> None:
        """One call; with ``scheduled`` (open loop) its latency counts from that moment."""
        recorder = self.recorder
        try:
            if self.sock is None:
                self.sock = _connect(self.plan)
            started = time.perf_counter()
            body = _exchange(self.sock, self.frame)
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            if scheduled is not None:
                elapsed_ms = max(elapsed_ms, (time.monotonic() - scheduled) * 1000.0)
        except (OSError, EOFError) as exc:
            recorder.fail(time.monotonic(), _failure_kind(exc))
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            return
        if elapsed_ms > self.plan["call_timeout_s"] * 1000.0:
            # Each recv had its own timeout; the whole call overran the caller's budget.
            recorder.fail(time.monotonic(), "timeout")
            return
        kind = classify_reply(body, self.plan["expect_ok"], self.exceptions)
        w = recorder.window(time.monotonic())
        if kind == "ok" or kind == "degraded":
            if MONITOR_CUT_BYTES in body:
                recorder.monitor_cut += 1
            if w >= 0:
                counts = recorder.ok if kind == "ok" else recorder.degraded
                counts[w][self.frame_index] += 1
                recorder.latencies[w][self.frame_index].append(elapsed_ms)
                self._maybe_sample(w, body)
            return
        recorder.fail(time.monotonic(), kind)
        if kind != "overloaded":
            return
        if self.plan["honour_retry_after"]:
            self.resume_at = time.monotonic() + _retry_after_s(self.plan["method"], body)
        elif self.plan["overloaded_pause_s"] > 0:  # a retry loop that ignores retry_after_ms
            self.resume_at = time.monotonic() + self.plan["overloaded_pause_s"]

    def _maybe_sample(self, window: int, body: bytes) -> None:
        every = self.plan["decode_every"]
        if not every or random.random() >= 1.0 / every:
            return
        try:
            outcomes = decode_result(self.plan["method"], body).success.outcomes or []
        except Exception:  # a sample that fails to decode is just not a sample
            return
        self.recorder.samples.append(
            {
                "window": window,
                "frame": self.frame_index,
                "outcomes_ms": {o.name: o.elapsed_ms for o in outcomes if o.status == 0},
            }
        )


def _open_connections(plan: dict[str, Any]) -> tuple[list[Any | None], dict[str, int]]:
    gate = Semaphore(plan["connect_concurrency"])
    sockets: list[Any | None] = [None] * plan["connections"]
    failures: dict[str, int] = {}

    def open_one(index: int) -> None:
        with gate:
            try:
                sockets[index] = _connect(plan)
            except OSError as exc:
                kind = "connect_" + _failure_kind(exc).removeprefix("connect_")
                failures[kind] = failures.get(kind, 0) + 1

    gevent.joinall(
        [gevent.spawn(open_one, i) for i in range(plan["connections"])],
        timeout=plan["connect_timeout_s"] * 3 + plan["connections"] / 100,
    )
    return sockets, failures


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _result(recorder: _Recorder, unfinished: int) -> dict[str, Any]:
    windows = [
        {
            "ok": recorder.ok[w],
            "degraded": recorder.degraded[w],
            "failures": recorder.failures[w],
            "latencies_ms": [
                base64.b64encode(a.tobytes()).decode("ascii") for a in recorder.latencies[w]
            ],
        }
        for w in range(recorder.reps)
    ]
    return {
        "event": "result",
        "windows": windows,
        "outside_failures": recorder.outside_failures,
        "samples": recorder.samples,
        "monitor_cut": recorder.monitor_cut,
        "unfinished": unfinished,
    }


def _write(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    _raise_fd_limit()
    plan = json.loads(sys.stdin.readline())
    frames = [base64.b64decode(f) for f in plan["frames"]]
    random.seed(plan["seed"])
    started = time.monotonic()
    sockets, connect_failures = _open_connections(plan)
    _write(
        {
            "event": "ready",
            "connected": sum(s is not None for s in sockets),
            "connect_failures": connect_failures,
            "connect_s": time.monotonic() - started,
            "pid": os.getpid(),
        }
    )
    go_at = json.loads(sys.stdin.readline())["go"]  # blocks the loop: the load has not begun
    recorder = _Recorder(plan, len(frames))
    recorder.measure_start = go_at + plan["warmup_s"]
    end_at = recorder.measure_start + plan["reps"] * plan["window_s"]
    callers = [_Caller(i, plan, frames, recorder, sock) for i, sock in enumerate(sockets)]
    interval = plan["interval_s"]
    greenlets = [
        gevent.spawn(c.run, go_at, end_at, random.uniform(0, interval) if interval else 0)
        for c in callers
    ]
    gevent.sleep(max(0.0, end_at - time.monotonic()))
    # Calls still in flight now would land after the last window: not waited for.
    done = gevent.joinall(greenlets, timeout=_END_GRACE_S)
    unfinished = len(greenlets) - len(done)
    gevent.killall(greenlets, timeout=2.0)
    _write(_result(recorder, unfinished))
    return 0


if __name__ == "__main__":
    sys.exit(main())
