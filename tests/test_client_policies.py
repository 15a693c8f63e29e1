"""The client's policies as pure logic: when to send a backup request, and when an ejected
or newly found instance may have calls again (the live behaviour is in
tests/test_instance_faults.py)."""

from __future__ import annotations

import time
from typing import Any

import gevent
import pytest

from service.client.hedging import MIN_SAMPLES, BackupRequests
from service.client.instances import SLOW_EJECT_AFTER, Instances


def _unproven(instance: Any) -> bool:
    """Read anew: a ping in another greenlet changes it."""
    return bool(instance.unproven)


def test_no_backup_until_the_tail_is_known_then_after_the_99th_percentile() -> None:
    backups = BackupRequests()
    for latency_ms in range(1, MIN_SAMPLES):
        backups.record(latency_ms / 1000.0)
    assert backups.delay_s() is None
    for latency_ms in range(MIN_SAMPLES, 201):  # 1..200 ms, evenly
        backups.record(latency_ms / 1000.0)
    # The 99th percentile of what was seen at the last refresh (every 32 samples): 1..178 ms.
    assert backups.delay_s() == pytest.approx(0.177, abs=0.0005)


def test_backups_stay_within_their_budget() -> None:
    backups = BackupRequests(ratio=0.05)
    allowed = sum(backups.allow() for _ in range(1000))
    assert 0 < allowed < 1000  # a burst, then refused
    assert not backups.allow()
    for _ in range(101):
        backups.budget.record_call()  # 101 calls earn 5.05 backups
    assert sum(backups.allow() for _ in range(100)) == 5


class _Pool:
    def close(self) -> None:
        pass


def _instances(prober: Any, eject_s: float = 0.05) -> Instances:
    return Instances(
        [("a", 1), ("b", 2)],
        lambda host, port: _Pool(),  # type: ignore[arg-type,return-value]
        eject_s=eject_s,
        prober=prober,
    )


def test_an_ejected_instance_gets_no_call_until_it_answers_a_ping() -> None:
    answers = {"a": False}
    probed: list[str] = []

    def prober(instance: Any) -> bool:
        probed.append(instance.host)
        return answers[instance.host]

    instances = _instances(prober)
    a = next(i for i in instances.all if i.host == "a")
    instances.eject(a)
    time.sleep(0.06)  # its ejection is over ...
    assert {instances.pick().host for _ in range(50)} == {"b"}  # ... but it is unproven
    gevent.sleep(0)  # the ping runs, and fails
    assert probed == ["a"] and a.unproven and a.ejected_until > time.monotonic()
    answers["a"] = True
    time.sleep(0.11)  # the second ejection, doubled, is over
    instances.pick()
    gevent.sleep(0)
    assert not _unproven(a)
    assert "a" in {instances.pick().host for _ in range(50)}


def test_an_instance_too_slow_three_times_in_a_row_is_ejected() -> None:
    instances = _instances(lambda instance: True, eject_s=60)
    a = next(i for i in instances.all if i.host == "a")
    for _ in range(SLOW_EJECT_AFTER - 1):
        instances.slow(a)
    a.succeeded()  # a success in between starts the count again
    for _ in range(SLOW_EJECT_AFTER - 1):
        instances.slow(a)
    assert a.eligible(time.monotonic())
    instances.slow(a)
    assert not a.eligible(time.monotonic()) and a.failures == 1
