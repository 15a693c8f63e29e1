"""The plots of a run (matplotlib, Agg backend, PNG): every bar and point carries its
95% interval as an error bar (the mean over repetitions of each repetition's figure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.analysis.plot_series import TRACING_MODES, only, tracing_series

__all__ = ["write_plots"]

Summaries = dict[str, dict[str, Any]]
_COLORS = {
    "fanout": "#1f77b4",
    "sequential": "#ff7f0e",
    "threaded": "#2ca02c",
    "bare": "#7f7f7f",
    "single-lookups": "#9467bd",
}


def _point(summaries: Summaries, key: str, figure: str) -> tuple[float, float, float] | None:
    """(mean, minus, plus) of a summary figure, or None when it did not run."""
    estimate = (summaries.get(key) or {}).get(figure)
    if not estimate:
        return None
    value = estimate["value"]
    return value, value - estimate["low"], estimate["high"] - value


def _bars(ax: Any, groups: list[str], series: dict[str, list[tuple[Any, ...] | None]]) -> None:
    width = 0.8 / max(1, len(series))
    for n, (name, points) in enumerate(series.items()):
        xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(groups))]
        present = [(x, p) for x, p in zip(xs, points) if p is not None]
        if not present:
            continue
        ax.bar(
            [x for x, _ in present],
            [p[0] for _, p in present],
            width,
            yerr=[[p[1] for _, p in present], [p[2] for _, p in present]],
            capsize=3,
            label=name,
            color=_COLORS.get(name),
        )
    ax.set_xticks(range(len(groups)), groups)
    ax.legend()


def _concurrency(summaries: Summaries, levels: list[int], path: Path) -> None:
    fig, (rps_ax, p99_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server in ("fanout", "sequential", "threaded"):
        points = [
            (
                c,
                _point(summaries, f"concurrency/{server}/c{c}", "rps"),
                _point(summaries, f"concurrency/{server}/c{c}", "p99_ms"),
            )
            for c in levels
        ]
        rps = [(c, p) for c, p, _ in points if p]
        p99 = [(c, p) for c, _, p in points if p]
        for ax, data in ((rps_ax, rps), (p99_ax, p99)):
            if data:
                ax.errorbar(
                    [c for c, _ in data],
                    [p[0] for _, p in data],
                    yerr=[[p[1] for _, p in data], [p[2] for _, p in data]],
                    marker="o",
                    capsize=3,
                    label=server,
                    color=_COLORS[server],
                )
    for ax, title in ((rps_ax, "complete replies per second"), (p99_ax, "p99 latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent connections (closed loop)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    p99_ax.set_yscale("log")
    fig.suptitle("get_app_stats, 7 lookups, 20 ms backend delay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _efficiency(
    summaries: Summaries, servers: list[str], slowest_ms: float | None, path: Path
) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    keys = [f"efficiency/{s}/c200" for s in servers]
    _bars(
        ax,
        servers,
        {
            "p50": [_point(summaries, k, "p50_ms") for k in keys],
            "p99": [_point(summaries, k, "p99_ms") for k in keys],
        },
    )
    if slowest_ms:
        ax.axhline(slowest_ms, color="black", linestyle="--", linewidth=1)
        ax.text(
            -0.45, slowest_ms * 1.03, f"slowest lookup alone, p50 {slowest_ms:.1f} ms", fontsize=8
        )
    ax.axhline(20, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel("request latency (ms), mean of per-window p50/p99")
    ax.set_title("Fan-out efficiency: 7 lookups of 20 ms, 200 callers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grouped(
    summaries: Summaries,
    title: str,
    ylabel: str,
    groups: list[str],
    series: dict[str, list[str]],
    figure: str,
    path: Path,
    log: bool = False,
) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    _bars(
        ax,
        groups,
        {name: [_point(summaries, k, figure) for k in keys] for name, keys in series.items()},
    )
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overload(summaries: Summaries, levels: list[int], path: Path) -> None:
    """Goodput against offered load (connections), one panel per regime."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, regime in zip(axes, ("cpu", "pool")):
        for server in ("fanout", "threaded"):
            data = [
                (c, _point(summaries, f"overload/{server}-{regime}/c{c}", "rps")) for c in levels
            ]
            points = [(c, p) for c, p in data if p]
            if points:
                ax.errorbar(
                    [c for c, _ in points],
                    [p[0] for _, p in points],
                    yerr=[[p[1] for _, p in points], [p[2] for _, p in points]],
                    marker="o",
                    capsize=3,
                    label=server,
                    color=_COLORS[server],
                )
        ax.set_xscale("log")
        ax.set_xlabel("closed-loop connections (offered load)")
        ax.set_ylabel("complete replies per second")
        ax.set_title(f"Goodput, {regime}-bound")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(
    summaries: Summaries, out_dir: Path, *, levels: dict[str, list[int]], slowest_ms: float | None
) -> list[Path]:
    """Write every plot whose configurations ran; returns the files written."""
    written = []
    if any(k.startswith("concurrency/") for k in summaries):
        written.append(out_dir / "concurrency.png")
        _concurrency(summaries, levels["concurrency"], written[-1])
    if any(k.startswith("efficiency/") for k in summaries):
        servers = [
            s for s in ("fanout", "sequential", "threaded") if f"efficiency/{s}/c200" in summaries
        ]
        written.append(out_dir / "efficiency.png")
        _efficiency(summaries, servers, slowest_ms, written[-1])
    if any(k.startswith("raw/") for k in summaries):
        raw = levels["raw"]
        written.append(out_dir / "raw_ping.png")
        _grouped(
            summaries,
            "Raw RPC: ping() calls per second",
            "calls per second",
            [f"{c} conn" for c in raw],
            {s: [f"raw/{s}/c{c}" for c in raw] for s in ("fanout", "bare", "threaded")},
            "rps",
            written[-1],
        )
    if any(k.startswith("tracing/") for k in summaries):
        written.append(out_dir / "tracing.png")
        _grouped(
            summaries,
            "Tracing cost: get_app_stats, closed loop",
            "complete replies per second",
            [label for _, label in TRACING_MODES],
            tracing_series(summaries),
            "rps",
            written[-1],
        )
    if any(k.startswith("workers/") for k in summaries):
        written.append(out_dir / "workers.png")
        _grouped(
            summaries,
            "server.workers on CPU-bound load (no backend delay)",
            "complete replies per second",
            ["1 worker", "2 workers"],
            {"fanout": [only(summaries, f"workers/workers-{w}/") for w in (1, 2)]},
            "rps",
            written[-1],
        )
    if any(k.startswith("overload/") for k in summaries):
        written.append(out_dir / "overload.png")
        _overload(summaries, levels.get("overload", []), written[-1])
    if any(k.startswith("concurrency/") for k in summaries):
        conc = levels["concurrency"]
        written.append(out_dir / "latency.png")
        _grouped(
            summaries,
            "Latency by concurrency (p99, mean over repetitions)",
            "p99 latency (ms)",
            [f"{c} conn" for c in conc],
            {
                s: [f"concurrency/{s}/c{c}" for c in conc]
                for s in ("fanout", "sequential", "threaded")
            },
            "p99_ms",
            written[-1],
            log=True,
        )
    return written
