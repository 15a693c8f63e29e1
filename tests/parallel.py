"""``make test``: the suite in a few pytest processes at once, each under gevent's patching.

Most tests wait (on servers, sockets, timers), so on this 2-core machine five
processes finish in well under a third of the time of one (five rather than four keeps
both cores busier while some processes wait). Each process is a whole
``python -m gevent.monkey --module pytest`` run over a share of the test files,
with session fixtures of its own (a MongoDB-wire server, the sample services);
they share only the machine and the wheel that the first to need it builds
(``FANOUT_TEST_SHARED``, a directory that lives as long as the run). Files are dealt longest first
to the least loaded process, by the seconds each took in a ``make test`` run
(:data:`SECONDS`; a file not listed counts as :data:`DEFAULT_S`).

Tests marked ``solo`` run after the rest, in one process per core (:data:`SOLO`,
``--solo-jobs``, dealt by :data:`SOLO_SECONDS`): each loads its own server with callers,
or holds it to a window of a few hundred milliseconds, and what it asserts is the
server's behaviour with a core to itself. Among four other processes on a slow host
their event loop stalled for half a second and more, and they failed for want of CPU,
not for a fault of the server; one beside another has a core of its own.

Before the first phase the project's own modules are compiled to bytecode
(:func:`compile_sources`), as the set-up compiles the installed packages: under
``PYTHONDONTWRITEBYTECODE`` no process writes it, and each of the suite's few hundred
(pytest, ``fanout serve`` and its workers, the CLI) compiled every module it imported
again, at every start.

Why not pytest-xdist: its workers are started by execnet, whose I/O loop runs in a
thread; under gevent's patching (which the server's code needs) that thread is
a greenlet blocking the whole process on its pipe. Whole processes need no such
care.

Usage: ``python tests/parallel.py [--jobs N] [--only A,B] [pytest arguments]``; ``--only``
deals only those test files, as the whole suite's are dealt. The arguments
(``-k``, ``-x``, ``-m``, ...) go to every process. With a path among them, that path runs
in one process, solo tests included, as plain pytest would. Exit status: the worst of
the processes'.
"""

from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Seconds per file among the other processes in a ``make test`` run on a quiet 2-core host
#: (the sum of its tests' setup, call and teardown, as ``--durations=0`` prints them), the
#: tests marked solo left out, the files of 3 s or more; a file's builds (the wheel, the
#: image, the interop clients, the site) and servers of its own (Zipkin) included.
SECONDS = {
    "test_results_cache.py": 65,
    "test_image.py": 54,
    "test_worker_group.py": 54,
    "test_workers.py": 48,
    "test_cache_parts.py": 45,
    "test_lifecycle.py": 42,
    "interop": 38,
    "test_cli.py": 37,
    "test_group_counts.py": 35,
    "test_packaging.py": 32,
    "test_trace_ui.py": 29,
    "test_prometheus.py": 27,
    "test_fuzz.py": 26,
    "test_docs.py": 24,
    "test_tutorial.py": 19,
    "test_tail_capture.py": 18,
    "test_mongo_monitor.py": 16,
    "test_instances.py": 16,
    "test_monitoring.py": 16,
    "test_secrets.py": 16,
    "test_plugins.py": 15,
    "test_capacity.py": 13,
    "test_mutual_tls.py": 12,
    "test_health.py": 12,
    "test_bench_asyncio_peer.py": 11,
    "test_merged_commands.py": 11,
    "test_tracing_otlp_wire.py": 9,
    "test_hub_monitor.py": 8,
    "test_backends.py": 8,
    "test_lookups_mongo.py": 7,
    "test_logs.py": 6,
    "test_pool_advice.py": 6,
    "test_cache_plans.py": 6,
    "test_parallel_runner.py": 6,
    "test_tracing_export.py": 6,
    "test_call_path.py": 6,
    "test_service.py": 6,
    "test_tls.py": 5,
    "test_resilience.py": 5,
    "test_bench_responder.py": 5,
    "test_callers.py": 4,
    "test_lookups_http.py": 4,
    "test_snapshot.py": 3,
    "test_fanout.py": 3,
}
DEFAULT_S = 1
#: The same for the tests marked solo, in a ``make test`` run's solo phase.
SOLO_SECONDS = {
    "test_backend_faults.py": 34,
    "test_instance_faults.py": 21,
    "test_worker_moves.py": 14,
    "test_brownout.py": 14,
    "test_pacing.py": 13,
    "test_held_connections.py": 12,
    "test_resilience.py": 11,
    "test_capacity.py": 8,
    "test_lifecycle.py": 4,
}
#: Files that need the shared wheel but not first: test_image.py, which needs it too, builds
#: it at the start of its group while these wait their turn (else one group waits on the
#: other's build).
AFTER_THE_WHEEL = ("test_packaging.py",)
#: The project's packages, compiled before the run (the installed ones are at set-up).
SOURCES = ("service", "lookups", "tracing", "tests", "bench")
#: The marker of the tests that run after the rest, in a process alone.
SOLO = "solo"
#: The files the solo phase reads, comma-separated, as the runner tells its processes
#: (tests/conftest.py refuses a run whose solo tests lie elsewhere).
SOLO_FILES_ENV = "FANOUT_TEST_SOLO_FILES"


def test_targets() -> list[str]:
    """Every test file, and the interop folder as one target."""
    targets = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    if (ROOT / "tests" / "interop").is_dir():
        targets.append("tests/interop")
    return targets


def solo_targets(targets: Sequence[str]) -> list[str]:
    """The files of ``targets`` that mark a test :data:`SOLO` (collecting every file for a
    few dozen tests took seconds of the solo phase, when nothing else runs)."""
    marker = f"mark.{SOLO}"
    return [
        target
        for target in targets
        if any(marker in path.read_text() for path in _files(ROOT / target))
    ]


def solo_tests_outside(tests: Iterable[tuple[str, bool]], solo_files: Iterable[str]) -> list[str]:
    """The ids among ``tests`` (node id, marked solo) of solo tests in no file of
    ``solo_files``: tests the group phase deselects and the solo phase never reads, because
    their file marks them in a way :func:`solo_targets`' search misses."""
    files = {Path(f) for f in solo_files}
    return [
        node_id
        for node_id, solo in tests
        if solo and not any(Path(node_id.split("::")[0]).is_relative_to(f) for f in files)
    ]


def _files(path: Path) -> list[Path]:
    return sorted(path.rglob("test_*.py")) if path.is_dir() else [path]


def deal(
    targets: Sequence[str], jobs: int, seconds: Mapping[str, float] = SECONDS
) -> list[list[str]]:
    """``targets`` in ``jobs`` groups of about equal ``seconds``, longest first (LPT); in
    each group the files of :data:`AFTER_THE_WHEEL` run last, once another group has built
    it."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0.0] * jobs
    for target in sorted(targets, key=lambda t: -seconds.get(Path(t).name, DEFAULT_S)):
        lightest = loads.index(min(loads))
        groups[lightest].append(target)
        loads[lightest] += seconds.get(Path(target).name, DEFAULT_S)
    return [
        sorted(group, key=lambda t: Path(t).name in AFTER_THE_WHEEL) for group in groups if group
    ]


def compile_sources(root: Path = ROOT) -> bool:
    """The bytecode of every module of :data:`SOURCES`, written beside it as Python writes
    it (``__pycache__``) whatever ``PYTHONDONTWRITEBYTECODE`` says; what is up to date is
    left. Whether all compiled (a syntax error is the tests' to report)."""
    return all(
        compileall.compile_dir(root / name, quiet=2, workers=0)
        for name in SOURCES
        if (root / name).is_dir()
    )


def phase_arguments(pytest_args: list[str], phase: str) -> list[str]:
    """``pytest_args`` with their ``-m EXPR`` joined to the marker expression of ``phase``
    ("rest" or :data:`SOLO`), as one ``-m`` at the end: pytest keeps only the last."""
    rest: list[str] = []
    chosen, args = None, iter(pytest_args)
    for arg in args:
        if arg == "-m":
            chosen = next(args, "")
        elif arg.startswith("-m") and len(arg) > 2:
            chosen = arg[2:]
        else:
            rest.append(arg)
    own = SOLO if phase == SOLO else f"not {SOLO}"
    return [*rest, "-m", f"({chosen}) and {own}" if chosen else own]


def run_phase(
    groups: list[list[str]], pytest_args: list[str], logs: list[Path], env: dict[str, str]
) -> list[int]:
    """One pytest process per group, all at once; their exit codes."""
    runs = []
    for group, log in zip(groups, logs):
        command = [
            sys.executable,
            "-m",
            "gevent.monkey",
            "--module",
            "pytest",
            "-p",
            "no:cacheprovider",
            *pytest_args,
            *group,
        ]
        runs.append(
            subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
            )
        )
    return [run.wait() for run in runs]


def report(groups: list[list[str]], logs: list[Path], codes: list[int], name: str) -> None:
    for index, (group, log, code) in enumerate(zip(groups, logs, codes)):
        text = log.read_text()
        tail = text if code not in (0, 5) else "\n".join(text.rstrip().splitlines()[-1:])
        print(
            f"--- {name} {index} ({len(group) or 'all'} targets), exit {code}, "
            f"log {log.relative_to(ROOT)}"
        )
        print(tail)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("TEST_JOBS", "5")))
    parser.add_argument(
        "--solo-jobs",
        type=int,
        default=int(os.environ.get("SOLO_JOBS", len(os.sched_getaffinity(0)))),
    )
    parser.add_argument("--only", default="", help="comma-separated test files, dealt alike")
    args, pytest_args = parser.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.support.toolchains import header_lines

    for line in header_lines():  # one line per missing toolchain, at the top as pytest's header
        print(line)
    started = time.monotonic()
    compile_sources()
    (ROOT / ".pytest-logs").mkdir(exist_ok=True)
    paths_given = any(
        not a.startswith("-") and Path(a.split("::")[0]).exists() for a in pytest_args
    )
    if paths_given:  # one ordinary run
        phases: list[tuple[str, list[list[str]], list[str]]] = [("run", [[]], pytest_args)]
    else:
        targets = args.only.split(",") if args.only else test_targets()
        phases = [
            ("group", deal(targets, max(1, args.jobs)), phase_arguments(pytest_args, "rest")),
            (
                SOLO,
                deal(solo_targets(targets), max(1, args.solo_jobs), SOLO_SECONDS),
                phase_arguments(pytest_args, SOLO),
            ),
        ]
    codes: list[int] = []
    with tempfile.TemporaryDirectory(prefix="fanout-tests-") as shared:
        # What the processes build once between them (the wheel: tests/support/dist.py).
        env = {**os.environ, "FANOUT_TEST_SHARED": shared}
        if not paths_given:  # each group process checks the solo phase misses none of its tests
            env[SOLO_FILES_ENV] = ",".join(solo_targets(targets))
        for name, groups, phase_args in phases:
            logs = [ROOT / ".pytest-logs" / f"{name}-{index}.log" for index in range(len(groups))]
            phase_codes = run_phase(groups, phase_args, logs, env)
            report(groups, logs, phase_codes, name)
            codes += phase_codes
    print(
        f"--- {sum(len(groups) for _, groups, _ in phases)} processes, "
        f"{time.monotonic() - started:.0f} s"
    )
    failing = [code for code in codes if code not in (0, 5)]  # 5: nothing collected (-k, -m)
    return max(failing) if failing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
