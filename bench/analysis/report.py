"""What a run leaves behind: the machine's facts, the summary of each configuration,
the printed tables (configurations, then goals with PASS/GAP) and ``results.json``."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from bench.analysis import stats
from bench.analysis.goals import Goal

__all__ = ["machine_facts", "summarize", "print_configs", "print_goals", "write_json"]

_PACKAGES = (
    "fanout",
    "thriftpy2",
    "gevent",
    "pymongo",
    "requests",
    # The asyncio peer's (bench/baselines/asyncio_peer.py), beside pymongo and thriftpy2.
    "uvloop",
    "aiohttp",
    "opentelemetry-sdk",
    "opentelemetry-instrumentation-pymongo",
    "psutil",
    "matplotlib",
    "tqdm",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return done.stdout.strip() + ("+uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_facts(argv: list[str]) -> dict[str, Any]:
    """CPU, cores, memory, OS, Python, package versions, date, command line, commit."""
    import psutil

    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": {p: _version(p) for p in _PACKAGES},
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench", *argv]),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": _git_commit(),
    }


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _mean_ci(values: list[float]) -> dict[str, float] | None:
    values = _finite(values)
    return stats.mean_ci(values).as_dict() if values else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Means with 95% intervals over repetitions, pooled percentiles, mean CPU per role."""
    reps = result.get("reps") or []
    if not reps:
        return {"key": result["key"], "error": result.get("error", "no repetitions")}
    roles = sorted({role for r in reps for role in r["cpu_pct"]})
    return {
        "key": result["key"],
        "rps": _mean_ci([r["rps"] for r in reps]),
        "replies_per_s": _mean_ci([r.get("replies_per_s", r["rps"]) for r in reps]),
        "p50_ms": _mean_ci([r["p50_ms"] for r in reps]),
        "p99_ms": _mean_ci([r["p99_ms"] for r in reps]),
        "pooled_p50_ms": result["pooled"]["p50_ms"],
        "pooled_p99_ms": result["pooled"]["p99_ms"],
        "calls": result["pooled"]["n"],
        "failed": sum(result["failures_total"].values()),
        "degraded": result["degraded_total"],
        "cpu_pct": {
            role: stats.mean_ci([r["cpu_pct"].get(role, 0.0) for r in reps]).value for role in roles
        },
        "loadgen_cpu_pct": stats.mean_ci([r["loadgen_cpu_pct"] for r in reps]).value,
        "other_cpu_pct": stats.mean_ci([r.get("other_cpu_pct", 0.0) for r in reps]).value,
        "error": result.get("error"),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def print_configs(
    results: list[dict[str, Any]], summaries: dict[str, dict[str, Any]], out: TextIO
) -> None:
    """One row per configuration: RPS with its interval, latency, failures and CPU by role."""
    rows = [
        [
            "configuration",
            "mongo",
            "RPS complete (95% CI)",
            "all replies/s",
            "p50 ms",
            "p99 ms",
            "failed",
            "degraded",
            "server CPU%",
            "backends CPU% (mongo/http/otlp)",
            "loadgen CPU%",
            "other CPU%",
        ]
    ]
    for result in results:
        summary = summaries[result["key"]]
        spec = result.get("spec") or {"mongo": "", "delay_ms": 0}  # none: it never ran
        mongo = spec["mongo"] + ("" if spec["delay_ms"] == 0 else f"+{spec['delay_ms']}ms")
        if summary.get("error") and "rps" not in summary:
            rows.append([result["key"], mongo, "ERROR: " + summary["error"][:60]] + [""] * 9)
            continue
        rps, cpu = summary["rps"], summary["cpu_pct"]
        rows.append(
            [
                result["key"],
                mongo,
                f"{_fmt(rps['value'])} +/- {_fmt(rps['value'] - rps['low'])}",
                _fmt(summary["replies_per_s"]["value"]),
                _fmt(summary["pooled_p50_ms"], 2),
                _fmt(summary["pooled_p99_ms"], 2),
                str(summary["failed"]),
                str(summary["degraded"]),
                _fmt(cpu.get("server"), 0),
                "/".join(_fmt(cpu.get(role), 0) for role in ("mongo", "http", "otlp")),
                _fmt(summary["loadgen_cpu_pct"], 0),
                _fmt(summary["other_cpu_pct"], 0),
            ]
        )
    _table(rows, out)


def print_goals(goals: list[Goal], out: TextIO) -> None:
    rows = [["scenario", "goal", "measured [95% CI]", "verdict", "note"]]
    rows += [[g.scenario, g.text, g.shown, g.verdict, g.note] for g in goals]
    _table(rows, out)


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=str, allow_nan=True) + "\n")
