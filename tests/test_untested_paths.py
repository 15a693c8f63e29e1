"""Paths a round of deliberate one-line bugs found no test running: each test here fails
when its path breaks (the group's circuit merge, the bytes of a next call carried on a
hand-over, the request slot given back, a Redis write failing)."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from gevent.lock import BoundedSemaphore

from lookups.cache.stores import RedisStore
from lookups.deadline import Deadline
from service.engine.fanout import FanOut
from service.engine.settings import FanOutSettings
from service.idl import appstats
from service.settings.config import load_settings
from service.workers.control import ControlLine
from service.workers.group_state import GroupState
from service.workers.member import GroupMember
from tests.support.redis_server import RedisServer
from tests.support.samples import StartService, backend_overrides
from tests.support.sockets import wait_for
from tests.support.thrift_calls import encode_call, frame


def test_the_group_reports_each_backend_s_worst_circuit(
    mongo_server: Any, http_services: Any
) -> None:
    settings = load_settings(env={}, overrides=backend_overrides(mongo_server, http_services))
    links: dict[int, Any] = {
        1: SimpleNamespace(circuits={"mongo": "closed", "alerts": "half_open", "metrics": "open"}),
        2: SimpleNamespace(
            circuits={"mongo": "half_open", "alerts": "closed", "metrics": "closed"}
        ),
        3: SimpleNamespace(circuits={"mongo": "open"}),
    }
    state = GroupState(settings, links, lambda: [])
    try:
        reported = wait_for(state.backends, 10, "the master's first round of checks")
        circuits = {status.name: status.circuit for status in reported}
        assert circuits == {"mongo": "open", "alerts": "half_open", "metrics": "open"}
        del links[3]
        assert {s.name: s.circuit for s in state.backends()}["mongo"] == "half_open"
    finally:
        state.close()


def test_a_next_call_s_bytes_already_read_move_with_the_connection(
    start_service: StartService,
) -> None:
    """A worker hands a connection to the master with the bytes it had read of the next
    call; the worker that adopts it serves that call once the rest arrives."""
    service, _ = start_service()
    worker_a, master_a = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker_b, master_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    moving = GroupMember(ControlLine(worker_a), 0)
    GroupMember(ControlLine(worker_b), 1).attach(service)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        caller = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    call = frame(encode_call("ping", appstats.AppStats.ping_args()))
    read_already, rest = call[:7], call[7:]
    try:
        assert moving._hand_over(accepted, read_already)
        accepted.close()
        received = ControlLine(master_a).receive()
        assert received is not None
        message, fd = received
        assert message == {"kind": "moved", "unread": read_already} and fd is not None
        ControlLine(master_b).send({"kind": "adopt", "unread": message["unread"]}, fd)
        caller.settimeout(10)
        caller.sendall(rest)
        reply = caller.recv(4096)
        assert b"ping" in reply and b"pong" in reply
    finally:
        caller.close()
        for end in (worker_a, master_a, worker_b, master_b):
            end.close()


def test_a_task_refused_a_process_slot_gives_its_request_slot_back() -> None:
    """Else the next task of the same call would wait for a request slot nobody holds,
    and be REJECTED though a process slot is free by then."""
    fan = FanOut(FanOutSettings(pool_size=1, max_inflight_tasks=1))
    request_slots = BoundedSemaphore(1)
    assert fan._inflight.acquire(timeout=0)  # another call holds the only process slot
    assert fan._acquire(request_slots, Deadline.after_ms(0)) is False
    fan._inflight.release()
    assert fan._acquire(request_slots, Deadline.after_ms(0)) is True


def test_a_redis_write_that_fails_is_counted_and_pauses_the_store(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(redis_server.url, 500, 60, pause_s=60.0)
    try:
        store.put_many({"fits": b"x"})
        assert store.get_many(["fits"]) == {"fits": b"x"} and store.stats.redis_errors == 0
        # Reads still work; every write is refused (as when Redis is out of memory).
        redis_server.client.config_set("maxmemory", "1")
        redis_server.client.config_set("maxmemory-policy", "noeviction")
        store.put_many({"refused": b"y" * 1000})
        assert store.stats.redis_errors == 1
        assert not store.available()  # paused: the panels are queried meanwhile
        assert store.get_many(["fits"]) == {}  # not asked while paused
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            redis_server.client.set("direct", b"z")
    finally:
        store.close()
