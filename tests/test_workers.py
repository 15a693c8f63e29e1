"""Pre-forked workers (``server.workers``): real ``fanout serve`` processes, real signals, real backends."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import psutil
import pytest

from service.settings.config import load_settings
from service.testing import FakeClock
from service.workers.master import _Master
from service.workers.positions import Positions
from tests.support.sockets import wait_for
from tests.support.workers import (  # noqa: F401 (serve: a fixture)
    PATIENT_START_S,
    Server,
    gather_all_panels,
    serve,
    set_server_keys,
)


def open_idle_connection(address: tuple[str, int]) -> socket.socket:
    """A connection that made one framed ``ping`` and stays open."""
    body = struct.pack("!iI", -2147418111, 4) + b"ping" + struct.pack("!i", 0) + b"\x00"
    sock = socket.create_connection(address, timeout=10)
    sock.sendall(struct.pack("!i", len(body)) + body)
    assert sock.recv(4096)
    return sock


def connections_of(pid: int, port: int) -> int:
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
    )


def test_two_workers_serve_restart_after_a_kill_and_stop_cleanly(
    serve: Callable[..., Server],
) -> None:
    server = serve("--workers", "2")
    assert server.line.endswith(f"(2 workers, master pid {server.process.pid})")
    workers = wait_for(lambda: len(server.workers()) == 2 and server.workers(), 10, "two workers")
    gather_all_panels(server.address)

    # Both workers accept from the one shared port.
    held = [open_idle_connection(server.address) for _ in range(40)]
    try:
        counts = wait_for(
            lambda: (
                (c := [connections_of(p, server.address[1]) for p in workers])
                and sum(c) == 40
                and c
            ),
            10,
            "40 connections accepted",
        )
        assert all(count > 0 for count in counts), counts
    finally:
        for sock in held:
            sock.close()

    os.kill(workers[0], signal.SIGKILL)
    replaced = wait_for(
        lambda: (now := server.workers()) and len(now) == 2 and workers[0] not in now and now,
        10,
        "a replacement worker",
    )
    assert workers[1] in replaced
    for _ in range(3):
        gather_all_panels(server.address)

    assert server.stop() == 0
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in replaced), 5, "workers gone")
    # Every line says which process wrote it (here the master's warning about the kill).
    logged = server.logged()
    assert re.search(r"WARNING master: service\.workers\.master: .*killed by SIGKILL", logged), (
        logged
    )


def test_one_worker_is_the_single_process_server(serve: Callable[..., Server]) -> None:
    server = serve()
    assert "workers" not in server.line
    gather_all_panels(server.address)
    assert server.workers() == []
    assert server.stop() == 0


def test_restart_backoff_doubles_and_a_storm_gives_up() -> None:
    clock = FakeClock()
    master = _Master(load_settings(env={}, overrides={"server.workers": 2}), clock=clock)
    position, other = list(master._positions)
    delays = []
    for pid in range(100, 110):
        master._positions.started(position, pid, pid)
        assert master._on_exit(pid, -signal.SIGKILL) is None  # killed by a signal: restart
        assert position.restart_at is not None
        delays.append(round(position.restart_at - clock.monotonic(), 1))
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]
    assert master._positions.due() == [] and master._positions.next_wake_in() == 0.5
    clock.advance(10.0)
    assert master._positions.due() == [position] and master._positions.next_wake_in() == 0.0
    master._positions.started(position, 110, 110)
    assert master._on_exit(110, 1) == 1  # the 11th in a minute: give up
    master._positions.started(other, 200, 200)
    assert master._on_exit(200, 2) == 2  # a configuration error: stop


def test_a_stable_worker_restarts_at_once_and_a_minute_forgets_a_storm() -> None:
    clock = FakeClock()
    positions = Positions(1, clock)
    [position] = positions
    for pid in range(100, 104):
        positions.started(position, pid, pid)
        delay = positions.died(position)
    assert delay == 0.8
    positions.started(position, 104, 104)
    clock.advance(10.0)  # it lived long enough: the back-off starts again
    assert positions.died(position) == 0.1
    for pid in range(105, 110):  # ten restarts within the minute: the storm's limit
        positions.started(position, pid, pid)
        assert positions.died(position) is not None
    positions.started(position, 110, 110)
    assert positions.died(position) is None  # the eleventh: a storm
    positions.started(position, 111, 111)
    clock.advance(60.1)  # a minute on, and a worker that lived it: all forgotten
    assert positions.died(position) == 0.1 and positions.recent_restarts == 1


def test_slots_grow_shrink_and_are_replaced_on_a_reload() -> None:
    positions = Positions(2)
    positions.started(positions.add(), 300, 1)
    assert [s.index for s in positions] == [0, 1, 2] and positions.pids() == [300]
    assert positions.storm_limit == 10 and positions.holding(300) is not None
    assert positions.remove_last().pid == 300 and len(positions) == 2
    old = positions.replace(4)
    assert (
        len(old) == 2 and [s.pid for s in positions] == [0, 0, 0, 0] and positions.storm_limit == 12
    )


def test_a_stuck_worker_is_killed_and_replaced(serve: Any, tmp_path: Path) -> None:
    set_server_keys(tmp_path / "fanout.toml", worker_heartbeat_timeout_ms=1500)
    server = serve("--workers", "2")
    first = wait_for(lambda: len(server.workers()) == 2 and server.workers(), 15, "two workers")
    held = [open_idle_connection(server.address) for _ in range(16)]
    wait_for(
        lambda: all(connections_of(pid, server.address[1]) for pid in first),
        10,
        "both workers serving",
    )
    stuck = first[0]
    os.kill(stuck, signal.SIGSTOP)  # its event loop stops: no more heartbeats
    replaced = wait_for(
        lambda: stuck not in server.workers() and len(server.workers()) == 2 and server.workers(),
        15,
        "the stuck worker replaced",
    )
    assert first[1] in replaced
    gather_all_panels(server.address)
    for sock in held:
        sock.close()
    assert server.stop() == 0
    logged = server.logged()
    assert "Traceback" not in logged, logged[-3000:]
    silent = re.search(
        rf"master: worker {stuck} \(position 0\) has not answered for ([\d.]+) s", logged
    )
    assert silent, logged[-3000:]
    # Killed soon after its heartbeat timeout: within the timeout and the master's check
    # interval, with room for a machine twice as slow, never minutes later.
    assert 1.5 <= float(silent.group(1)) <= 1.5 + 6.0


def test_sighup_reloads_the_configuration_and_replaces_every_worker(
    serve: Any, tmp_path: Path
) -> None:
    config = tmp_path / "fanout.toml"
    set_server_keys(config, workers=2)
    server = serve()
    old = wait_for(lambda: len(server.workers()) == 2 and server.workers(), 15, "two workers")
    set_server_keys(config, workers=3)
    server.process.send_signal(signal.SIGHUP)
    new = wait_for(
        lambda: (w := server.workers()) and len(w) == 3 and not set(w) & set(old) and w,
        20,
        "three new workers, the old ones gone",
    )
    assert len(new) == 3
    gather_all_panels(server.address)
    assert server.stop() == 0


@pytest.mark.timeout(4 * PATIENT_START_S)  # three waits of a start's patience, and the stop
def test_sigttin_and_sigttou_add_and_retire_a_worker(serve: Any) -> None:
    server = serve("--workers", "2")
    # A start, and a retiring worker's drain, take a starved machine's patience.
    before = wait_for(
        lambda: len(server.workers()) == 2 and server.workers(), PATIENT_START_S, "two workers"
    )
    server.process.send_signal(signal.SIGTTIN)
    grown = wait_for(
        lambda: len(server.workers()) == 3 and server.workers(), PATIENT_START_S, "three workers"
    )
    assert set(before) <= set(grown)  # the running workers stay
    server.process.send_signal(signal.SIGTTOU)
    wait_for(lambda: len(server.workers()) == 2, PATIENT_START_S, "two workers again")
    gather_all_panels(server.address)
    assert server.stop() == 0


def test_connections_spread_only_on_a_clear_imbalance() -> None:
    from service.workers.balance import excess

    assert excess({1: 32, 2: 0}) == {1: 16}  # a replaced worker takes half
    assert excess({1: 20, 2: 6, 3: 6}) == {1: 9}  # down to the mean, rounded up
    assert excess({1: 2, 2: 0}) == {1: 1}
    assert excess({1: 17, 2: 15}) == {} and excess({1: 1, 2: 0}) == {}  # near enough: no churn
    assert excess({1: 40}) == {}  # one worker: nowhere to go


def test_a_reload_whose_backends_cannot_be_built_is_refused_and_the_workers_stay(
    serve: Any, tmp_path: Path
) -> None:
    config = tmp_path / "fanout.toml"
    server = serve("--workers", "2")
    before = wait_for(lambda: len(server.workers()) == 2 and server.workers(), 15, "two workers")
    with config.open("a") as toml:  # the last table is [http]: a CA file that is not there
        toml.write(f'ca_file = "{tmp_path / "no-such-ca.pem"}"\n')
    server.process.send_signal(signal.SIGHUP)
    gevent.sleep(2.0)  # what a reload takes here: the new workers would have started by now
    assert server.workers() == before and server.process.poll() is None
    gather_all_panels(server.address)
    assert server.stop() == 0
    logged = server.logged()
    assert "the new configuration is refused, keeping the old" in logged, logged[-3000:]
    assert "Traceback" not in logged


def test_a_starting_worker_keeps_its_grace_until_it_serves_then_beats_in_time() -> None:
    """Before it serves, a worker's beats date its file START_GRACE_S ahead: a start whose
    loop is held longer than the heartbeat timeout (parts built on a busy machine) is not
    taken for a stuck worker. Once it announces, its beats are dated now."""
    from lookups.clock import SYSTEM_CLOCK
    from service.workers.heartbeat import START_GRACE_S, Heartbeats

    master = Heartbeats()
    try:
        master.reset(7)
        worker = Heartbeats(master.directory)
        beating = worker.start_beating(7)
        gevent.sleep(0.01)  # it beat once, starting
        assert master.path(7).stat().st_mtime > SYSTEM_CLOCK.wall() + START_GRACE_S - 5
        assert master.age_s(7) == 0.0
        worker.announce(7, metrics="http://127.0.0.1:1/metrics")
        gevent.sleep(0.01)
        assert abs(master.path(7).stat().st_mtime - SYSTEM_CLOCK.wall()) < 5
        assert master.announcement(7) is not None
        beating.kill()
    finally:
        master.remove()


def test_a_worker_is_stuck_once_its_beat_is_older_than_the_timeout_on_the_service_clock() -> None:
    """The boundary exactly, on a clock the test moves: a worker beating every BEAT_S is
    never stuck; once its loop stops beating, it is not stuck at the timeout and is just
    past it. No wall time is waited, so a busy machine can make it neither late nor early."""
    from service.testing import FakeClock
    from service.workers.heartbeat import BEAT_S, Heartbeats
    from service.workers.positions import Positions

    clock = FakeClock(wall_start=time.time())  # heartbeat files are dated on its wall time
    master = Heartbeats(clock=clock)
    try:
        positions = Positions(1, clock)
        position = next(iter(positions))
        positions.started(position, pid=os.getpid(), serial=3)
        master.reset(3)
        worker = Heartbeats(master.directory, clock)
        beating = worker.start_beating(3)
        worker.announce(3)
        for _ in range(10):  # 5 s of beats, one every BEAT_S
            clock.advance(BEAT_S)
            assert master.age_s(3) == pytest.approx(0.0, abs=1e-3)
            assert positions.stuck(master, timeout_ms=1500) == []
        beating.kill()  # its loop stops: no more beats
        clock.advance(1.499)
        assert master.age_s(3) == pytest.approx(1.499, abs=1e-3)
        assert positions.stuck(master, timeout_ms=1500) == []
        clock.advance(0.002)
        assert positions.stuck(master, timeout_ms=1500) == [position]
    finally:
        master.remove()


def test_a_new_master_removes_the_quiet_directories_of_masters_that_are_gone(
    tmp_path: Path,
) -> None:
    """A master killed outright leaves its heartbeat directory; the next one removes it once
    nothing in it has changed for a while, and never one whose master lives or beats."""
    from service.workers.heartbeat import ABANDONED_AFTER_S, remove_abandoned

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - ABANDONED_AFTER_S - 60

    def directory(name: str, pid: int | None, modified: float) -> Path:
        made = tmp_path / f"fanout-heartbeat-{name}"
        made.mkdir()
        (made / "worker-1").touch()
        if pid is not None:
            (made / "master.pid").write_text(str(pid))
        for path in (*made.iterdir(), made):
            os.utime(path, (modified, modified))
        return made

    killed = directory("killed", gone.pid, old)
    unnamed = directory("unnamed", None, old)
    living = directory("living", os.getpid(), old)
    beating = directory("beating", gone.pid, time.time())
    (beating / "worker-1").touch()
    other = tmp_path / "not-ours"
    other.mkdir()
    os.utime(other, (old, old))

    assert sorted(remove_abandoned(tmp_path, now=time.time())) == sorted([killed, unnamed])
    assert {p.name for p in tmp_path.iterdir()} == {living.name, beating.name, other.name}


def test_a_master_names_itself_in_its_directory_and_removes_it() -> None:
    from service.workers.heartbeat import Heartbeats

    master = Heartbeats()
    made = Path(master.directory)
    assert (made / "master.pid").read_text() == str(os.getpid())
    master.remove()
    assert not made.exists()


@pytest.mark.parametrize(
    ("state", "cpu_since_beat_s", "stuck"),
    [
        ("R", 0.2, False),  # runnable, ran little: waiting for a core on a busy machine
        ("R", 1.5, True),  # ran half the timeout without returning to its loop
        ("T", 0.0, True),  # stopped (SIGSTOP)
        ("S", 0.0, True),  # asleep in something that never wakes its loop
        ("D", 0.0, True),
    ],
)
def test_a_worker_that_missed_its_beats_is_stuck_unless_it_waited_for_a_core(
    state: str, cpu_since_beat_s: float, stuck: bool
) -> None:
    from service.workers.heartbeat import ProcessState, looks_stuck

    assert looks_stuck(ProcessState(state, 10.0), cpu_since_beat_s, 3.0) is stuck
    assert looks_stuck(None, 0.0, 3.0)  # gone, or no /proc: as before


def test_the_kernel_tells_a_stopped_process_from_a_running_one() -> None:
    from service.workers.heartbeat import process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        stopped = wait_for(lambda: (s := process_state(child.pid)) and s.state == "T" and s, 5)
        assert stopped.cpu_s >= 0.0
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: (s := process_state(child.pid)) and s.state in "RS", 5)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None  # reaped: gone
