"""Where a call's CPU goes: a sampling profile of the CPU-bound closed loop, and the
system calls a call makes, for Fanout and for the hand-written gevent server.

    python -m bench.profile [--connections 20] [--window-s 15]      (make bench-profile)

Each server runs on a fresh stack (:mod:`bench.harness.stack`: the MongoDB-wire
responder and the HTTP backend with no added delay, tracing off) under a closed loop of
``--connections`` connections asking for every panel. After a warm-up, three windows:

1. the server's CPU per call, from ``/proc``, nothing attached;
2. py-spy (``record --nonblocking --format raw``) samples the server: each sample's
   innermost frame is charged to its package (``gevent``, ``pymongo``, the standard
   library...) and, for our own code, to its module (self time);
3. ``strace -c -f`` counts the server's system calls: per call answered, by name.

strace slows the server while it counts, so only its counts per call are kept, never its
timings; py-spy reads the process from outside without stopping it. Writes
``bench/results/profile.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.analysis.goals import info_row
from bench.analysis.report import machine_facts
from bench.harness.runner import Config, Timing, plan_of
from bench.harness.scenario import _config
from bench.harness.stack import start_stack
from bench.load.loadgen import LoadResult, run_load

RESULTS = Path(__file__).resolve().parent / "results" / "profile.json"
SERVERS = ("fanout", "handwritten")
#: Our own packages: charged by module; everything else by package.
OWN = ("service", "lookups", "tracing", "bench")
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


def charge(path: str) -> tuple[str, str]:
    """``(package, module)`` a frame's file is charged to; module is "" outside our code.

    py-spy runs with ``--full-filenames``: a file is named by its whole path
    (``.../site-packages/requests/sessions.py``, ``.../lib/python3.11/threading.py``),
    gevent's compiled modules by their source (``src/gevent/_hub_primitives.py``), our
    own by their path in the checkout or the installed package. OpenTelemetry's
    namespace package is split by its second part (``opentelemetry.sdk``,
    ``opentelemetry.instrumentation``...): its SDK's ``trace`` package must not be taken
    for the standard library's ``trace`` module, as py-spy's shortened names made it.
    """
    parts = _from_import_root(Path(path).parts)
    if not parts:
        return ("other", "")
    if parts[0] == "opentelemetry" and len(parts) > 2:
        return (".".join(parts[:2]), "")
    top = parts[0].removesuffix(".py")
    if top in OWN:
        return (top, "/".join(parts))
    if top in sys.stdlib_module_names or top.startswith("<frozen"):
        return ("stdlib", "")
    if top.startswith(("<", "__")):  # code made at run time: dataclasses, namedtuples, exec
        return ("generated", "")
    return (top, "")


def _from_import_root(parts: tuple[str, ...]) -> tuple[str, ...]:
    """A file's path parts from the directory it was imported from."""
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1 :]
    versions = [i for i, part in enumerate(parts) if re.fullmatch(r"python3\.\d+", part)]
    if versions:  # the standard library
        return parts[versions[0] + 1 :]
    own = [i for i, part in enumerate(parts) if part in OWN]
    if own:  # ours, in a checkout
        return parts[own[0] :]
    if "src" in parts:  # a compiled module named by its source
        return parts[len(parts) - parts[::-1].index("src") :]
    return parts


def fold(raw: str) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks as self-time shares by package and by our module."""
    packages: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        found = _FRAME.match(leaf)
        package, module = charge(found.group("path")) if found else ("other", "")
        packages[package] += int(count)
        if module:
            modules[module] += int(count)
        total += int(count)
    share: dict[str, Any] = {"samples": total}
    if total:
        share["by_package"] = {k: round(v / total, 4) for k, v in packages.most_common()}
        share["by_own_module"] = {k: round(v / total, 4) for k, v in modules.most_common(25)}
    return share


def syscalls(summary: str) -> Counter[str]:
    """Calls by name from ``strace -c``'s table."""
    counts: Counter[str] = Counter()
    for line in summary.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) >= 5 and fields[-1] != "total" and fields[3].isdigit():
            counts[fields[-1]] += int(fields[3])
    return counts


def profile_server(server: str, connections: int, window_s: float, work: Path) -> dict[str, Any]:
    """The three windows above for ``server``; their figures."""
    config: Config = _config("profile", server, "stats", connections, delay_ms=0)
    timing = Timing(reps=3, window_s=window_s, warmup_s=5.0)
    spy_out, trace_out = work / f"{server}.spy", work / f"{server}.strace"
    with start_stack(config.spec) as stack:
        pid = stack.server_pids()[0]
        running: dict[str, subprocess.Popen[bytes]] = {}
        cpu: list[float] = []

        def boundary(index: int) -> None:
            cpu.append(stack.cpu_seconds()["server"])
            if index == 1:
                running["spy"] = _start_py_spy(pid, window_s, spy_out)
            elif index == 2:
                running["strace"] = subprocess.Popen(
                    ["strace", "-c", "-f", "-p", str(pid), "-o", str(trace_out)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            elif index == 3 and "strace" in running:
                running["strace"].send_signal(signal.SIGINT)

        load = run_load(plan_of(config, stack.address, timing), on_boundary=boundary)
        for process in running.values():
            process.wait(timeout=60)
    calls = [sum(window.ok) + sum(window.degraded) for window in load.windows]
    return {
        "calls_per_s": round(calls[0] / window_s, 1),
        "cpu_ms_per_call": round((cpu[1] - cpu[0]) * 1000 / max(calls[0], 1), 4),
        "failed": _failures(load),
        "profile": fold(spy_out.read_text()) if spy_out.exists() else {"samples": 0},
        "syscalls_per_call": _per_call(trace_out, calls[2]),
    }


def _start_py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen(
        [
            *(spy, "record", "--nonblocking", "--full-filenames", "--format", "raw"),
            *("--rate", "250"),
            *("--duration", str(int(seconds)), "--pid", str(pid), "--output", str(out)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _per_call(trace_out: Path, calls: int) -> dict[str, float]:
    if not trace_out.exists() or not calls:
        return {}
    counts = syscalls(trace_out.read_text())
    per_call = {name: round(n / calls, 2) for name, n in counts.most_common(12)}
    return {"all": round(sum(counts.values()) / calls, 2), **per_call}


def _failures(load: LoadResult) -> int:
    return sum(sum(window.failures.values()) for window in load.windows)


def profile_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the manual's performance page shows: each server's figures, the shares."""
    rows = []
    for server in SERVERS:
        figures = results[server]
        calls = figures["syscalls_per_call"]
        rows += [
            info_row(
                "profile",
                f"{server}: CPU per call (ms, one window)",
                f"{figures['cpu_ms_per_call']:.2f}",
            ),
            info_row("profile", f"{server}: system calls per call", f"{calls.get('all', 0):.1f}"),
            info_row(
                "profile",
                f"{server}: system calls per call, by name",
                ", ".join(f"{name} {n}" for name, n in calls.items() if name != "all"),
            ),
        ]
        for key, title in (("by_package", "by package"), ("by_own_module", "by our module")):
            shares = figures["profile"].get(key, {})
            shown = ", ".join(f"{name} {share:.1%}" for name, share in list(shares.items())[:10])
            rows.append(info_row("profile", f"{server}: self time {title}", shown))
    return [row.as_dict() for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    if shutil.which("strace") is None:
        print("profile: skipped: needs strace (apt-get install strace)")
        return 0
    results: dict[str, Any] = {"machine": machine_facts(sys.argv), "connections": args.connections}
    with tempfile.TemporaryDirectory(prefix="fanout-profile-") as work:
        for server in SERVERS:
            results[server] = profile_server(server, args.connections, args.window_s, Path(work))
            print(f"profile: {server}: {json.dumps(results[server])}", flush=True)
    results["goals"] = profile_rows(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["goals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
