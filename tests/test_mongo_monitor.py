"""pymongo's monitor answered late never fails a call: a real nx-27017 behind a proxy that
holds back each monitor check 1.5 s, with calls in flight the whole time."""

from __future__ import annotations

import time
from typing import Any

import bson
import gevent

from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.mongo_monitor import LateMonitorProxy, command_name
from tests.support.samples import StartService

LATE_MS = 1500
#: The panels on MongoDB: the HTTP ones are not this test's (a stressed run saw them cut).
MONGO_PANELS = ("errors", "urls", "controllers", "queries")
CALLING_S = 8.0
#: Each command held back this long on its way, so that a few callers without a pause keep
#: operations in flight at every check, while the engine idles between them (flat out, eight
#: callers made this file one of the suite's costliest in CPU).
COMMAND_DELAY_MS = 250
CALLERS = 3
#: pymongo's smallest heartbeat interval: a check every half second, each answered late.
FREQUENT_CHECKS = "heartbeatFrequencyMS=500"


def test_command_name_reads_op_msg_and_op_query() -> None:
    document = bson.encode({"hello": 1, "$db": "admin"})
    op_msg = struct_header(2013) + b"\0\0\0\0" + b"\0" + document
    op_query = struct_header(2004) + b"\0\0\0\0" + b"admin.$cmd\0" + b"\0" * 8 + document
    assert command_name(op_msg) == "hello" and command_name(op_query) == "hello"
    assert command_name(struct_header(2013) + b"\0\0\0\0\0" + bson.encode({"find": "x"})) == "find"
    assert command_name(b"short") == ""


def struct_header(opcode: int) -> bytes:
    return (0).to_bytes(4, "little") * 3 + opcode.to_bytes(4, "little")


def _failed_panels(
    start_service: StartService, mongo_server: Any, **overrides: Any
) -> tuple[list[str], int]:
    """A few callers for a few seconds through a proxy answering the monitor late: the
    MongoDB panels that failed, as ``panel: status: message``, and the checks pymongo gave up on."""
    proxy = LateMonitorProxy(("127.0.0.1", mongo_server.port), LATE_MS).start()
    proxy.set_delay_ms(COMMAND_DELAY_MS)
    try:
        _, client = start_service(
            mongo__uri=f"mongodb://127.0.0.1:{proxy.address[1]}/?{FREQUENT_CHECKS}",
            fanout__task_timeout_ms=4_000,
            fanout__request_deadline_ms=4_500,
            **overrides,
        )
        failed: list[str] = []
        until = time.monotonic() + CALLING_S

        def call() -> None:
            while time.monotonic() < until:
                response = client.get_app_stats(
                    "shop", SAMPLE_START_MS, SAMPLE_END_MS, list(MONGO_PANELS)
                )
                failed.extend(
                    f"{o.name}: {appstats.TaskStatus._VALUES_TO_NAMES[o.status]}: {o.message}"
                    for o in response.outcomes
                    if o.status != appstats.TaskStatus.OK
                )

        gevent.joinall([gevent.spawn(call) for _ in range(CALLERS)], raise_error=True)
        assert proxy.held >= 3, "the monitor's checks were not held: the test proves nothing"
        return failed, proxy.abandoned
    finally:
        proxy.stop()


def test_a_monitor_answered_late_fails_no_call(
    start_service: StartService, mongo_server: Any
) -> None:
    assert _failed_panels(start_service, mongo_server) == ([], 0)


def test_with_a_monitor_timeout_below_the_late_answer_pymongo_gives_up_on_its_checks(
    start_service: StartService, mongo_server: Any
) -> None:
    """Why the default is long: below the late answer pymongo times each held check out,
    marks the server unknown and clears its pool, failing the operations in flight (how
    many fail depends on the moment: their retries may still make it within budget)."""
    _, abandoned = _failed_panels(start_service, mongo_server, mongo__connect_timeout_ms=1000)
    assert abandoned >= 1
