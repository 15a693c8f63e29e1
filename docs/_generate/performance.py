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
    "steady-storm.json": "A steady storm: capacity minute after minute, and what refusals "
    'cost (`make bench BENCH_ARGS="--only steady"`)',
    "merged-commands.json": "One MongoDB command for the urls and controllers panels, "
    'against nx-27017 (`make bench BENCH_ARGS="--only merge"`)',
    "cpu.json": 'CPU per call (`make bench BENCH_ARGS="--only cpu"`)',
    "peer.json": 'Fanout beside an asyncio peer (`make bench BENCH_ARGS="--only peer"`)',
    "trace-storm.json": "Tail capture at its ceiling for five minutes under a storm of failing "
    'calls (`make bench BENCH_ARGS="--only trace-storm"`)',
    "tracing.json": 'Tracing cost and the CPU of one span (`make bench BENCH_ARGS="--only '
    'tracing,micro"`)',
    "cost.json": "CPU, tracing, efficiency, latency and coalescing",
    "after-gc.json": "Tracing, latency, coalescing and Python versions",
    "dashboard.json": "The results cache with many dashboard viewers (`make bench-dashboard`)",
    "group.json": "Several workers as one service (`make bench-group`)",
    "alerts-trial.json": "The shipped alerts on a real Prometheus (`make bench-alerts`): "
    "each alert's pending and firing spans in seconds from the trial's start",
    "idle.json": "An idle server (`make bench-idle`)",
    "profile.json": "Where a call's CPU goes (`make bench-profile`)",
    "dashboard-measured-plan.json": 'The results cache with `cache.plan = "measured"`, its '
    "first design, means of windows minutes apart (`bench.dashboard --plan measured`, "
    "2-minute buckets; its nx-27017 runs were saturated by the uncached load itself)",
    "dashboard-alone-probes.json": 'The results cache with `cache.plan = "measured"` by '
    "timings alone on the engine, its third design (`bench.dashboard --plan measured`, "
    "2-minute buckets; the engines' runs at two commits, as `runs` says)",
    "dashboard-query-first.json": 'The results cache with `cache.plan = "measured"`, the '
    "default: the query answers until a timing finds the buckets cheaper "
    "(`bench.dashboard --plan measured`, 2-minute buckets; `runs` says at which commits)",
    "dashboard-nx-measured.json": 'The results cache on nx-27017 with `cache.plan = "measured"`'
    " by its second design, paired timings inside calls (`bench.dashboard --engines nx-27017 "
    "--plan measured`, 2-minute buckets)",
}
#: Runs of a design or a scenario since replaced: on the log page, not the index.
SUPERSEDED = {
    "cost.json": "results.json and tracing.json",
    "after-gc.json": "results.json and tracing.json",
    "dashboard-measured-plan.json": "dashboard-query-first.json",
    "dashboard-alone-probes.json": "dashboard-query-first.json",
    "dashboard-nx-measured.json": "dashboard-query-first.json",
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
    current = [r for r in dated if r[0].name not in SUPERSEDED]
    return {
        "index.md": _index(results, current, [r for r in undated if r[0].name not in SUPERSEDED]),
        "log.md": _log(dated, undated, [r for r in runs if r[0].name in SUPERSEDED]),
    }


def _newest_plots(dated: list[Any]) -> dict[str, str]:
    """Each plot file by the results file of the newest run that lists it: a run writes its
    plots over the last run's, so an older section's plot is no longer its own."""
    owners: dict[str, str] = {}
    for path, data in dated:  # newest first
        plots = data.get("plots") or []
        for plot in plots if isinstance(plots, list) else list(plots):
            owners.setdefault(plot, path.name)
    return owners


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
    owners = _newest_plots(dated)
    for path, data in dated:
        lines += _dated_section(results, path, data, owners)
    for path, data in undated:
        lines += _undated_section(path, data)
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


def _undated_section(path: Path, data: dict[str, Any], level: str = "##") -> list[str]:
    lines = [
        f"{level} {TITLES.get(path.name, path.name)}",
        "",
        f"From `{path.name}` (the file records no machine).",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    lines += [f"| {key} | {_value(value)} |" for key, value in _flatten(data)]
    return [*lines, ""]


def _dated_section(
    results: Path, path: Path, data: dict[str, Any], owners: dict[str, str], level: str = "##"
) -> list[str]:
    lines = [
        f"{level} {TITLES.get(path.name, path.name)}",
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
        if owners.get(plot) == path.name and (results / plot).exists():
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


def _log(dated: list[Any], undated: list[Any], superseded: list[Any]) -> str:
    lines = [
        "# Performance log",
        "",
        "Every run the results files hold, newest first; then the runs of designs and "
        "scenarios since replaced, whole.",
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
    if superseded:
        lines += ["", "## Superseded runs", ""]
    for path, data in superseded:
        section = (
            _dated_section(path.parent, path, data, {}, "###")
            if "machine" in data
            else _undated_section(path, data, "###")
        )
        lines += [section[0], "", f"Superseded by {SUPERSEDED[path.name]}.", *section[1:]]
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
