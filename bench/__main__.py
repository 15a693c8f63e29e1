"""``python -m bench``: Fanout, the sequential and the threaded baselines, side by side.

Every configuration runs on a fresh stack (servers and backends started for it and
torn down after it) under a fresh load generator; each of its repetitions is one
measured window after a warm-up. Results go to ``--out`` (default bench/results/):
``results.json`` (every repetition's figures, the summaries, the goals, the machine)
and PNG plots; the tables with the PASS/GAP verdicts are printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.analysis import plots, report
from bench.analysis.goals import Goal, micro_goals
from bench.harness.runner import Config, Timing, at_capacity_fraction, panel_names, run_config
from bench.harness.scenarios import SCENARIO_NAMES, Scale, Scenario, all_scenarios

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parent.parent
_FULL = Timing(reps=30, window_s=0.5, warmup_s=2.5)
_QUICK = Timing(reps=5, window_s=0.3, warmup_s=1.0)
_MICRO_TIMEOUT_S = 900
# Seconds to start and stop a stack, measured on the reference machine (see docs/performance/running.md).
_STARTUP_S = {"responder": 2.5, "nx": 6.0}
_TEARDOWN_S = 1.5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="5 repetitions, shorter windows, fewer levels (< 3 minutes)",
    )
    parser.add_argument(
        "--reps", type=int, help="repetitions per configuration (default 30, quick 5)"
    )
    parser.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIO_NAMES))
    parser.add_argument(
        "--out",
        default=str(_ROOT / "bench" / "results"),
        help="output directory (default bench/results)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the configurations and the time estimate, run nothing",
    )
    return parser


def _estimate_s(config: Config, timing: Timing) -> float:
    spec = config.spec
    startup = _STARTUP_S.get(spec.mongo, 3.0) + 0.5 * (spec.workers - 1)
    startup += 1.0 if spec.tracing == "full" else 0.0
    connect = config.connections / 3000
    t = config.timing(timing)
    return startup + connect + t.warmup_s + t.reps * t.window_s + 0.5 + _TEARDOWN_S


def _micro_estimate_s(quick: bool) -> float:
    return 10.0 if quick else 15.0


def _print_plan(scenarios: list[Scenario], timing: Timing, with_micro: bool, quick: bool) -> float:
    total = 0.0
    print(f"{'configuration':<40} {'conns':>6} {'reps':>5} {'window':>7} {'est. s':>7}")
    for scenario in scenarios:
        for config in scenario.configs:
            estimate = _estimate_s(config, timing)
            total += estimate
            t = config.timing(timing)
            print(
                f"{config.key:<40} {config.connections:>6} {t.reps:>5} "
                f"{t.window_s:>6.2f}s {estimate:>7.1f}"
            )
    if with_micro:
        total += _micro_estimate_s(quick)
        print(
            f"{'micro (bench.micro)':<40} {'':>6} {'':>5} {'':>7} {_micro_estimate_s(quick):>7.1f}"
        )
    print(f"estimated total: {total / 60:.1f} minutes")
    return total


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _run_micro(reps: int, quick: bool) -> tuple[dict[str, Any] | None, str]:
    command = [sys.executable, "-m", "bench.micro", "--reps", str(reps)]
    command += ["--quick"] if quick else []
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=_ROOT, timeout=_MICRO_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None, f"bench.micro did not finish within {_MICRO_TIMEOUT_S} s"
    if done.returncode != 0:
        return None, f"bench.micro failed ({done.returncode}): {done.stderr[-500:]}"
    text = done.stdout
    try:  # the JSON document is the end of what it prints, possibly over several lines
        return json.loads(text[text.index("{") :]), ""
    except ValueError:
        return None, "bench.micro printed no JSON"


def _advance(progress: tqdm[Any]) -> None:
    progress.update(1)


def _run_configs(
    scenarios: list[Scenario], timing: Timing, progress: tqdm[Any]
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    configs = [c for s in scenarios for c in s.configs]
    remaining = sum(_estimate_s(c, timing) for c in configs)
    for config in configs:
        progress.set_postfix_str(f"{config.key} (~{remaining / 60:.1f} min left)")
        try:
            config = at_capacity_fraction(config, results)
        except ValueError as exc:
            results.append(
                {
                    "key": config.key,
                    "scenario": config.scenario,
                    "label": config.label,
                    "error": str(exc),
                }
            )
            progress.update(config.timing(timing).reps)
            remaining -= _estimate_s(config, timing)
            progress.write(f"{config.key}: ERROR {exc}")
            continue
        result = run_config(config, timing, on_window=lambda: _advance(progress))
        remaining -= _estimate_s(config, timing)
        planned = config.timing(timing).reps
        progress.update(planned - len(result.get("reps") or []))  # keep the bar honest on errors
        summary = report.summarize(result)
        if summary.get("error"):
            progress.write(f"{config.key}: ERROR {summary['error']}")
        else:
            progress.write(
                f"{config.key}: {summary['rps']['value']:,.0f} rps, "
                f"p99 {summary['pooled_p99_ms']:.1f} ms, failed {summary['failed']}, "
                f"{result['total_s']:.0f} s"
            )
        results.append(result)
    return results


def _slowest_lookup_ms(results: list[dict[str, Any]]) -> float | None:
    for result in results:
        single = f"efficiency/single-lookups/c{len(panel_names())}"
        if result["key"] == single and "pooled" in result:
            return max(f["p50_ms"] for f in result["pooled"]["frames"])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - set(SCENARIO_NAMES)
    if unknown:
        print(
            f"unknown scenario(s): {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(SCENARIO_NAMES)}",
            file=sys.stderr,
        )
        return 2
    base = _QUICK if args.quick else _FULL
    timing = Timing(args.reps or base.reps, base.window_s, base.warmup_s)
    scenarios = all_scenarios(Scale(quick=args.quick), only)
    with_micro = only is None or "micro" in only
    print(
        "Fanout benchmark: every configuration on a fresh stack; load generator, servers "
        "and backends share this machine's CPUs."
    )
    estimate = _print_plan(scenarios, timing, with_micro, args.quick)
    if args.plan:
        return 0
    _raise_fd_limit()
    facts = report.machine_facts(argv_list)
    out = Path(args.out)
    started = time.monotonic()
    total_reps = sum(c.timing(timing).reps for s in scenarios for c in s.configs)
    # Redrawn at most every 2 s when the output is a file (make bench > log).
    with tqdm(
        total=total_reps,
        unit="rep",
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 2.0,
    ) as progress:
        results = _run_configs(scenarios, timing, progress)
    micro, micro_error = (None, "")
    if with_micro:
        print("running the micro-benchmarks (bench.micro) ...", flush=True)
        micro, micro_error = _run_micro(timing.reps, args.quick)
    return _finish(
        out,
        facts,
        scenarios,
        results,
        micro,
        micro_error,
        with_micro,
        time.monotonic() - started,
        estimate,
        timing,
        args.quick,
    )


def _finish(
    out: Path,
    facts: dict[str, Any],
    scenarios: list[Scenario],
    results: list[dict[str, Any]],
    micro: dict[str, Any] | None,
    micro_error: str,
    with_micro: bool,
    duration_s: float,
    estimate_s: float,
    timing: Timing,
    quick: bool,
) -> int:
    by_key = {r["key"]: r for r in results}
    summaries = {r["key"]: report.summarize(r) for r in results}
    goals: list[Goal] = [g for s in scenarios for g in s.goals(by_key)]
    if with_micro:
        goals += micro_goals(micro, micro_error)
    levels = {
        "concurrency": sorted(
            {c.connections for s in scenarios for c in s.configs if s.name == "concurrency"}
        ),
        "raw": sorted({c.connections for s in scenarios for c in s.configs if s.name == "raw"}),
        "overload": sorted(
            {
                c.connections
                for s in scenarios
                for c in s.configs
                if s.name == "overload" and "refusals" not in c.label
            }
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    pngs = plots.write_plots(summaries, out, levels=levels, slowest_ms=_slowest_lookup_ms(results))
    report.write_json(
        out / "results.json",
        {
            "machine": facts,
            "quick": quick,
            "timing": dataclasses.asdict(timing),
            "duration_s": duration_s,
            "estimated_s": estimate_s,
            "notes": {s.name: s.notes for s in scenarios},
            "summaries": summaries,
            "goals": [g.as_dict() for g in goals],
            "micro": micro,
            "configs": results,
            "plots": [p.name for p in pngs],
        },
    )
    print()
    print(
        f"Machine: {facts['cpu_model']}, {facts['usable_cpus']} CPUs, {facts['memory_gib']} GiB, "
        f"{facts['os']}, Python {facts['python']}; load generator, servers and backends all "
        f"on these CPUs."
    )
    print(
        f"Command: {facts['command']}   ({duration_s / 60:.1f} min, estimated "
        f"{estimate_s / 60:.1f})\n"
    )
    report.print_configs(results, summaries, sys.stdout)
    print(
        f"CPU%: 100 = one core of {facts['usable_cpus']}, mean over the measured windows. "
        "other = the rest of the machine meanwhile (other users, this harness): a noise gauge."
    )
    print()
    for scenario in scenarios:
        for note in scenario.notes:
            print(f"[{scenario.name}] {note}")
    print()
    report.print_goals(goals, sys.stdout)
    print(f"\nresults: {out / 'results.json'}; plots: {', '.join(p.name for p in pngs)}")
    return 1 if any(g.verdict == "ERROR" for g in goals) else 0


if __name__ == "__main__":
    sys.exit(main())
