"""Several workers as one service: reloads, a killed worker, a stopped one, the group's
scrape, a backend going down, and a TLS handshake in slow motion.

    python -m bench.group [--only reloads,kill,stop,scrapes,backend,handshake]

Each phase runs a real ``fanout serve --workers 2`` with probes and Prometheus on,
over the sample backends (20 ms each), on loopback. The callers are plain thriftpy2
clients, each holding one connection (``bench.group_callers``), as a web tier's
Thrift pool does. It prints one JSON report; every phase stops by itself and
stops every process it started.

* ``reloads``: five SIGHUPs 3 s apart under 16, then 32 connections: failed calls.
* ``kill``: 32 connections, ``kill -9`` of one worker: each worker's share of the
  calls in the 5 s windows after its replacement serves, and the failed calls
  against the connections the killed worker held.
* ``counts``: three rounds of 16 connections through three SIGHUPs 3.3 s apart and a
  ``kill -9`` of one worker, the group scraped every second: the calls the merged scrape
  counts against those the callers got answered, and the calls cut by the kill.
* ``stop``: 32 connections, SIGSTOP of one worker: the longest stall a caller saw,
  and what the master logged.
* ``scrapes``: one keep-alive connection scraping every 0.5 s through two reloads
  and a kill: scrapes that parsed and carried both workers' series.
* ``backend``: the MongoDB backend goes away with no calls arriving, then comes
  back: seconds until the probes and every worker's gauge say so.
* ``handshake``: a TLS ClientHello sent a byte every 0.5 s, ``frame_timeout_ms`` 2000:
  seconds from its first byte until the server closes it.
* ``rest``: 16 connections for 5 s (so every series has its labels), then nothing but a
  scrape every second for 30 s: the master's CPU (share of a core, per scrape, per
  sample of the merged scrape) and each worker's CPU a second, from ``/proc``.

The report is printed and written into ``bench/results/group.json`` (published as
``docs/performance/group.json``), each phase run replacing its own figures there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gevent
import psutil
import requests

from bench.group_callers import Callers
from bench.group_server import Group, calls_by_worker, group_memory, wait, workers_in
from service.samples import DemoBackends
from service.samples.faults import TcpFaultProxy
from service.samples.mongo_server import free_port

PHASES = ("reloads", "kill", "counts", "stop", "scrapes", "backend", "handshake", "rest")
RESULTS = Path(__file__).resolve().parent / "results" / "group.json"
REST_S = 30.0


def reloads(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    report = {}
    for connections in (16, 32):
        group = Group(backends, workdir, f"reloads-{connections}")
        callers = Callers(group.ports["thrift"], connections)
        gevent.sleep(2.0)
        steady = len(callers.calls)
        for _ in range(5):
            group.process.send_signal(signal.SIGHUP)
            gevent.sleep(3.0)
        callers.stop()
        report[f"{connections}_connections"] = {
            "calls_ok": callers.ok,
            "incomplete": callers.incomplete,
            "failed": callers.failures,
            "p99_ms_before": _p99_ms(callers.calls[:steady]),
            "p99_ms_through_reloads": _p99_ms(callers.calls[steady:]),
            "longest_ms_through_reloads": round(
                1000 * max(s for _, s, _ in callers.calls[steady:]), 1
            ),
            **group.stop(),
        }
    return report


def _p99_ms(calls: list[tuple[float, float, bool]]) -> float:
    durations = sorted(seconds for _, seconds, _ in calls)
    return round(1000 * durations[int(0.99 * (len(durations) - 1))], 1) if durations else 0.0


def kill(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    group = Group(backends, workdir, "kill")
    callers = Callers(group.ports["thrift"], 32)
    gevent.sleep(3.0)
    victim = group.workers()[0]
    held = sum(
        1
        for c in psutil.Process(victim).net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == group.ports["thrift"]
    )
    group.kill(victim)
    shares, before = [], calls_by_worker(group.scrape())
    for _ in range(3):
        gevent.sleep(5.0)
        after = calls_by_worker(group.scrape())
        delta = {w: after.get(w, 0.0) - before.get(w, 0.0) for w in after}
        total = sum(delta.values()) or 1.0
        shares.append({w: round(v / total, 3) for w, v in sorted(delta.items())})
        before = after
    callers.stop()
    return {
        "connections_on_the_killed_worker": held,
        "failed": callers.failures,
        "calls_ok": callers.ok,
        "incomplete": callers.incomplete,
        "shares_per_5s_after_replacement": shares,
        "memory": group_memory(group),
        **group.stop(),
    }


def counts(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    return {"rounds": [_counted_round(backends, workdir, number) for number in range(3)]}


def _counted_round(backends: DemoBackends, workdir: Path, number: int) -> dict[str, Any]:
    group = Group(backends, workdir, f"counts-{number}")
    wait(group.all_serving, 30, "both workers serving")
    callers = Callers(group.ports["thrift"], 16)
    resets, last = [0], [dict[str, float]()]

    def poll() -> None:  # as Prometheus scrapes: a counter that goes back is a reset
        while True:
            seen = calls_by_worker(group.scrape())
            resets[0] += sum(1 for w, n in seen.items() if n < last[0].get(w, 0.0))
            last[0] = seen
            gevent.sleep(1.0)

    poller = gevent.spawn(poll)
    for _ in range(3):
        group.process.send_signal(signal.SIGHUP)
        gevent.sleep(3.3)
    group.kill(group.workers()[0])
    gevent.sleep(3.0)
    callers.finish()
    poller.kill()
    counted = sum(calls_by_worker(group.scrape()).values())
    declared = callers.answered() - callers.ok - callers.incomplete
    return {
        "answered": callers.answered(),
        "counted": counted,
        "cut_by_the_kill": callers.failed() - declared,
        "counter_resets": resets[0],
        **group.stop(),
    }


def stop(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    group = Group(backends, workdir, "stop")
    callers = Callers(group.ports["thrift"], 32)
    gevent.sleep(3.0)
    victim = group.workers()[0]
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    states = []
    while victim in group.workers() and time.monotonic() - stopped_at < 20:
        states.append(sorted(group.probe()["workers"].values()))
        gevent.sleep(0.5)
    replaced_s = time.monotonic() - stopped_at
    wait(group.all_serving, 30, "the replacement serving")
    gevent.sleep(2.0)
    callers.stop()
    in_flight = [s for started, s, _ in callers.calls if started + s >= stopped_at]
    text = group.log.read_text()
    return {
        "killed_and_replaced_after_s": round(replaced_s, 2),
        "longest_stall_s": round(max(in_flight, default=0.0), 2),
        "failed": callers.failures,
        "calls_ok": callers.ok,
        "probe_said_unresponsive": any("unresponsive" in s for s in states),
        "master_lines_about_it": text.count("has not answered"),
        **group.stop(),
    }


def scrapes(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    group = Group(backends, workdir, "scrapes")
    session, seen = requests.Session(), []
    wait(lambda: workers_in(group.scrape(session)) == {"0", "1"}, 20, "both workers scraped")

    def poll() -> None:
        while True:
            try:
                seen.append(workers_in(group.scrape(session)))
            except Exception as exc:
                seen.append({f"error: {type(exc).__name__}"})
            gevent.sleep(0.5)

    poller = gevent.spawn(poll)
    for _ in range(2):
        group.reload_and_wait()
        gevent.sleep(1.0)
    group.kill(group.workers()[0])
    gevent.sleep(2.0)
    poller.kill()
    return {
        "scrapes": len(seen),
        "with_both_workers": sum(1 for s in seen if s == {"0", "1"}),
        "other": [sorted(s) for s in seen if s != {"0", "1"}],
        **group.stop(),
    }


def backend(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    port, target = free_port(), ("127.0.0.1", backends.mongo.port)
    proxy = TcpFaultProxy(target, port=port).start()
    group = Group(
        backends, workdir, "backend", **{"backends.mongo.uri": f"mongodb://127.0.0.1:{port}"}
    )

    def shown(up: bool) -> bool:
        gauges = re.findall(
            r'^fanout_backend_up\{.*fanout_backend="mongo".*\} (\S+)$', group.scrape(), re.M
        )
        return (
            group.probe()["backends"]["mongo"]["up"] is up
            and len(gauges) == 2
            and all(float(g) == float(up) for g in gauges)
        )

    wait(lambda: shown(True), 20, "mongo up")
    gevent.sleep(1.0)
    went = time.monotonic()
    proxy.stop()
    wait(lambda: shown(False), 30, "mongo down everywhere")
    down_s = time.monotonic() - went
    came = time.monotonic()
    proxy = TcpFaultProxy(target, port=port).start()
    wait(lambda: shown(True), 30, "mongo up again everywhere")
    up_s = time.monotonic() - came
    proxy.stop()
    return {
        "down_shown_after_s": round(down_s, 2),
        "up_shown_after_s": round(up_s, 2),
        **group.stop(),
    }


def handshake(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    import trustme

    authority = trustme.CA()
    cert = authority.issue_cert("localhost", "127.0.0.1")
    cert_file, key_file = workdir / "cert.pem", workdir / "key.pem"
    cert.cert_chain_pems[0].write_to_path(cert_file)
    cert.private_key_pem.write_to_path(key_file)
    group = Group(
        backends,
        workdir,
        "handshake",
        **{
            "server.tls_cert_file": cert_file,
            "server.tls_key_file": key_file,
            "server.frame_timeout_ms": 2000,
        },
    )
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    try:
        context.wrap_bio(incoming, outgoing, server_hostname="localhost").do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
    closed_after = None
    with socket.create_connection(("127.0.0.1", group.ports["thrift"]), timeout=0.5) as slow:
        first = time.monotonic()  # each recv waits 0.5 s: the pace of the bytes
        for byte in hello:
            try:
                slow.sendall(bytes([byte]))
                if slow.recv(1) == b"":
                    raise ConnectionResetError
            except TimeoutError:
                pass
            except OSError:
                closed_after = time.monotonic() - first
                break
    return {
        "hello_bytes": len(hello),
        "closed_after_s": closed_after and round(closed_after, 2),
        "frame_timeout_ms": 2000,
        **group.stop(),
    }


def rest(backends: DemoBackends, workdir: Path) -> dict[str, Any]:
    group = Group(backends, workdir, "rest")
    wait(group.all_serving, 30, "both workers serving")
    callers = Callers(group.ports["thrift"], 16)
    gevent.sleep(5.0)
    callers.stop()
    session = requests.Session()
    processes = [psutil.Process(pid) for pid in (group.process.pid, *group.workers())]
    text = group.scrape(session)
    before, began, scrapes = [_cpu_s(p) for p in processes], time.monotonic(), 0
    while time.monotonic() - began < REST_S:
        scrapes += 1
        text = group.scrape(session)
        gevent.sleep(max(0.0, began + scrapes - time.monotonic()))
    elapsed = time.monotonic() - began
    spent = [_cpu_s(p) - b for p, b in zip(processes, before)]
    samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return {
        "seconds": round(elapsed, 1),
        "scrapes": scrapes,
        "merged_scrape_bytes": len(text.encode()),
        "merged_scrape_samples": samples,
        "master_percent_of_a_core": round(100 * spent[0] / elapsed, 2),
        "master_cpu_ms_per_scrape": round(1000 * spent[0] / scrapes, 2),
        "master_cpu_us_per_sample": round(1e6 * spent[0] / scrapes / max(samples, 1), 2),
        "worker_cpu_ms_per_s": [round(1000 * s / elapsed, 2) for s in spent[1:]],
        **group.stop(),
    }


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PHASES))
    phases = parser.parse_args().only.split(",")
    report: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="fanout-group-") as workdir,
        DemoBackends(alerts_delay_ms=20, metrics_delay_ms=20) as backends,
    ):
        for phase in phases:
            report[phase] = globals()[phase](backends, Path(workdir))
            print(f"{phase}: {json.dumps(report[phase])}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**kept, **report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
