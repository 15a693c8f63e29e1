"""The soak run's trouble-makers: backends that change mode over time, and garbage connections.

Each runs in its own greenlet until ``stop`` is set, and counts what it did in ``tally``.
On the way out every backend is put back to healthy.
"""

from __future__ import annotations

import random
import socket
import struct
from collections import Counter

import gevent
from gevent.event import Event

from service.samples.faults import FaultyHttpService, TcpFaultProxy

__all__ = ["cycle_http", "cycle_mongo", "GARBAGE_KINDS", "send_garbage", "run_garbage"]

# (mode, weight): mostly healthy, every fault now and then.
_HTTP_MODES = [
    ("ok", 10),
    ("slow", 3),
    ("error500", 1),
    ("bad_json", 1),
    ("hang", 1),
    ("reset", 1),
    ("reset_partial", 1),
    ("refuse", 1),
]
_MONGO_MODES = [("ok", 10), ("spike", 4), ("pause", 1), ("reset_all", 1)]
_PHASE_S = (2.0, 8.0)


def _pick(rng: random.Random, modes: list[tuple[str, int]]) -> str:
    return rng.choices([m for m, _ in modes], [w for _, w in modes])[0]


def cycle_http(
    name: str, service: FaultyHttpService, rng: random.Random, stop: Event, tally: Counter[str]
) -> None:
    """Switch ``service`` between healthy and each fault mode, a few seconds at a time."""
    try:
        while not stop.is_set():
            mode = _pick(rng, _HTTP_MODES)
            tally[f"{name} {mode}"] += 1
            if mode == "refuse":
                service.refuse()
                stop.wait(rng.uniform(*_PHASE_S))
                service.resume()
                continue
            if mode == "slow":
                service.set_mode("slow", delay_ms=rng.randint(100, 2500))
            elif mode == "reset_partial":
                service.set_mode("reset", partial=True)
            else:
                service.set_mode(mode)
            stop.wait(rng.uniform(*_PHASE_S))
    finally:
        service.set_mode("ok")
        if not service.listening:
            service.resume()


def cycle_mongo(proxy: TcpFaultProxy, rng: random.Random, stop: Event, tally: Counter[str]) -> None:
    """Delay spikes, pauses and resets in front of MongoDB, between healthy stretches."""
    try:
        while not stop.is_set():
            mode = _pick(rng, _MONGO_MODES)
            tally[f"mongo {mode}"] += 1
            proxy.set_delay_ms(rng.randint(200, 2000) if mode == "spike" else 0)
            if mode == "pause":
                proxy.pause()
                stop.wait(rng.uniform(0.5, 3.0))
                proxy.resume()
            elif mode == "reset_all":
                proxy.reset_all()
            stop.wait(rng.uniform(*_PHASE_S))
    finally:
        proxy.set_delay_ms(0)
        proxy.resume()


GARBAGE_KINDS = ("random_bytes", "truncated_frame", "slow_drip", "oversized_length", "idle")
_READ_LIMIT_S = 10.0  # past server.frame_timeout_ms (5 s by default)
_DRIP_PAUSE_S = 0.3


def _ping_frame() -> bytes:
    """A valid framed, strict-binary ``ping`` call: what a slow client would drip."""
    name = b"ping"
    payload = struct.pack(">iI", -2147418111, len(name)) + name + struct.pack(">i", 1) + b"\x00"
    return struct.pack(">i", len(payload)) + payload


def send_garbage(address: tuple[str, int], kind: str, rng: random.Random) -> str:
    """One misbehaving connection of ``kind``; how it ended: closed, answered, open or refused."""
    try:
        sock = socket.create_connection(address, timeout=2.0)
    except OSError:
        return "refused"
    try:
        sock.settimeout(_READ_LIMIT_S)
        _misbehave(sock, kind, rng)
        return _how_it_ends(sock)
    except OSError:
        return "closed"
    finally:
        sock.close()


def _misbehave(sock: socket.socket, kind: str, rng: random.Random) -> None:
    if kind == "random_bytes":
        sock.sendall(rng.randbytes(rng.randint(1, 4096)))
    elif kind == "truncated_frame":
        sock.sendall(struct.pack(">i", 200) + rng.randbytes(20))
    elif kind == "oversized_length":
        sock.sendall(struct.pack(">i", 0x7FFFFFFF) + b"\x80\x01")
    elif kind == "slow_drip":
        for byte in _ping_frame():
            sock.sendall(bytes([byte]))
            gevent.sleep(_DRIP_PAUSE_S)
    else:  # idle: connect, say nothing, leave
        gevent.sleep(rng.uniform(0.5, 2.0))
        sock.shutdown(socket.SHUT_WR)


def _how_it_ends(sock: socket.socket) -> str:
    answered = False
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return "answered" if answered else "closed"
            answered = True
    except TimeoutError:
        return "open"


def run_garbage(
    address: tuple[str, int], rng: random.Random, stop: Event, tally: Counter[str]
) -> None:
    """Open misbehaving connections one after another until ``stop``."""
    while not stop.is_set():
        kind = rng.choice(GARBAGE_KINDS)
        tally[f"{kind} {send_garbage(address, kind, rng)}"] += 1
        stop.wait(rng.uniform(0.0, 0.5))
