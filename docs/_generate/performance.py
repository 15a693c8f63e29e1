"""The manual's performance pages, made from the benchmarks' results files.

``make bench`` and its siblings write JSON into ``docs/performance/``. Each file that
records its machine (``machine``: date, cores, load at start, commit, command) and its
goals (each with the figure shown, its 95% interval and a verdict) becomes a section of
``performance/index.md``; the files without a machine record (``dashboard.json``,
``group.json``) are shown as their figures, flattened. ``performance/log.md`` lists every
run the files hold, newest first. Figures are never copied into a hand-written page.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["pages", "cell"]

#: What each results file measures, by its name (a file not named here shows its name).
TITLES = {
    "results.json": "The whole benchmark (`make bench`)",
    "brownout.json": 'Brownout and criticality (`make bench BENCH_ARGS="--only brownout"`)',
    "fair-share.json": 'Fair share per caller (`make bench BENCH_ARGS="--only fair"`)',
    "cpu.json": 'CPU per call (`make bench BENCH_ARGS="--only cpu"`)',
    "tracing.json": 'Tracing cost and the CPU of one span (`make bench BENCH_ARGS="--only '
    'tracing,micro"`)',
    "cost.json": "CPU, tracing, efficiency, latency and coalescing",
    "after-gc.json": "Tracing, latency, coalescing and Python versions",
    "dashboard.json": "The results cache with many dashboard viewers (`make bench-dashboard`)",
    "group.json": "Several workers as one service (`make bench-group`)",
    "idle.json": "An idle server (`make bench-idle`)",
    "profile.json": "Where a call's CPU goes (`make bench-profile`)",
    "dashboard-measured-plan.json": 'The results cache with `cache.plan = "measured"`, its '
    "first design, means of windows minutes apart (`bench.dashboard --plan measured`, "
    "2-minute buckets; its nx-27017 runs were saturated by the uncached load itself)",
    "dashboard-alone-probes.json": 'The results cache with `cache.plan = "measured"` by '
    "probes alone on the engine, its third design (`bench.dashboard --plan measured`, "
    "2-minute buckets; the engines' runs at two commits, as `runs` says)",
    "dashboard-query-first.json": 'The results cache with `cache.plan = "measured"` '
    "answering by the query until a probe finds the buckets cheaper, its fourth design and "
    "the default (`bench.dashboard --plan measured`, 2-minute buckets; `runs` says at which "
    "commits)",
    "dashboard-nx-measured.json": 'The results cache on nx-27017 with `cache.plan = "measured"`'
    " by its second design, paired probes inside calls (`bench.dashboard --engines nx-27017 "
    "--plan measured`, 2-minute buckets)",
}
#: Text reports the benchmark writes beside its JSON, shown under the run they belong to.
TEXT_REPORTS = {"results.json": "results.txt"}
LOOSE_TEXT_REPORTS = {"overload.txt": "The overload scenario's table (`--only overload`)"}


def pages(results: Path) -> dict[str, str]:
    """``{"index.md": ..., "log.md": ...}`` from the results files in ``results``."""
    runs = [(path, json.loads(path.read_text())) for path in sorted(results.glob("*.json"))]
    dated = sorted(
        (r for r in runs if "machine" in r[1]),
        key=lambda r: r[1]["machine"].get("date_utc", ""),
        reverse=True,
    )
    undated = [r for r in runs if "machine" not in r[1]]
    return {"index.md": _index(results, dated, undated), "log.md": _log(dated, undated)}


def _index(results: Path, dated: list[Any], undated: list[Any]) -> str:
    lines = [
        "# Performance",
        "",
        "Every figure here is read from a results file in `docs/performance/` when the "
        "manual is built; [Running the benchmarks](running.md) says how each is made. "
        "A ratio is shown with its 95% interval; `PASS` and `GAP` compare the interval "
        "with the goal. [The log](log.md) lists every run these files hold.",
        "",
    ]
    for path, data in dated:
        lines += _dated_section(results, path, data)
    for path, data in undated:
        lines += [
            f"## {TITLES.get(path.name, path.name)}",
            "",
            f"From `{path.name}` (the file records no machine).",
            "",
            "| figure | value |",
            "| --- | --- |",
        ]
        lines += [f"| {key} | {_value(value)} |" for key, value in _flatten(data)]
        lines.append("")
    for name, title in LOOSE_TEXT_REPORTS.items():
        if (results / name).exists():
            lines += [
                f"## {title}",
                "",
                "```text",
                (results / name).read_text().rstrip(),
                "```",
                "",
            ]
    return "\n".join(lines)


def _dated_section(results: Path, path: Path, data: dict[str, Any]) -> list[str]:
    lines = [
        f"## {TITLES.get(path.name, path.name)}",
        "",
        _machine_line(path, data),
        "",
        "| goal | figure [95% interval] | verdict |",
        "| --- | --- | --- |",
    ]
    for goal in data.get("goals", []):
        lines.append(f"| {cell(goal['text'])} | {goal['shown']} | {goal['verdict']} |")
    lines.append("")
    plots = data.get("plots") or []
    for plot in plots if isinstance(plots, list) else list(plots):
        if (results / plot).exists():
            lines += [f"![{plot}]({plot})", ""]
    report = TEXT_REPORTS.get(path.name)
    if report and (results / report).exists():
        lines += [
            '??? note "The benchmark\'s own table"',
            "",
            *(
                "    " + line
                for line in ["```text", *(results / report).read_text().splitlines(), "```"]
            ),
            "",
        ]
    return lines


def _machine_line(path: Path, data: dict[str, Any]) -> str:
    machine = data["machine"]
    load = machine.get("load_average_at_start") or []
    return (
        f"From `{path.name}`: run {machine.get('date_utc', '?')} at commit "
        f"`{machine.get('git_commit', '?')}`, `{machine.get('command', '?')}`; "
        f"{machine.get('cpu_model', '?')}, {machine.get('usable_cpus', '?')} usable cores, "
        f"{machine.get('memory_gib', '?')} GiB, Python {machine.get('python', '?')}; "
        f"load average at start {', '.join(str(x) for x in load)}."
    )


def _log(dated: list[Any], undated: list[Any]) -> str:
    lines = [
        "# Performance log",
        "",
        "Every run the results files hold, newest first.",
        "",
        "| date (UTC) | file | commit | command | load at start | goals met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for path, data in dated:
        machine = data["machine"]
        goals = data.get("goals", [])
        met = sum(1 for g in goals if g.get("verdict") == "PASS")
        lines.append(
            f"| {machine.get('date_utc', '?')} | `{path.name}` | "
            f"`{machine.get('git_commit', '?')}` | `{machine.get('command', '?')}` | "
            f"{', '.join(str(x) for x in machine.get('load_average_at_start') or [])}"
            f" | {met} of {len(goals)} |"
        )
    for path, _ in undated:
        lines.append(f"| (not recorded) | `{path.name}` | | | | |")
    return "\n".join(lines) + "\n"


def _flatten(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict) and not {"value", "low", "high"} <= set(data):
        for key, value in data.items():
            yield from _flatten(value, f"{prefix} / {key}" if prefix else str(key))
    elif isinstance(data, list) and data and isinstance(data[0], (dict, list)):
        for n, value in enumerate(data):
            yield from _flatten(value, f"{prefix} [{n}]")
    else:
        yield prefix, data


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['value']:.3g} [{value['low']:.3g}, {value['high']:.3g}] (n={value['n']})"
    if isinstance(value, float):
        return f"{value:.3g}"
    return cell(json.dumps(value) if isinstance(value, (list, dict)) else str(value))


def cell(text: str) -> str:
    """``text`` as one Markdown table cell: on one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")
