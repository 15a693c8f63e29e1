"""Two groups of callers on one stack at once, for the brownout scenario.

The primary group is the configuration's own (its connections, its criticality, its
pacing), every reply decoded, so that its goodput counts the calls whose essential
panels were all OK; the companion group (:class:`Companion`: how many, which
criticality, how they retry) loads the same server from load-generator processes of
its own. The companion starts first and the primary once the companion's
connections are open, so that their windows overlap. Meanwhile the server's brownout
level is read every half second (``pool_stats``), for the dimmer's range.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lookups.settings import SHIPPED_OPTIONAL

__all__ = ["Companion", "run_mixed"]

_LEVEL_POLL_S = 0.5


@dataclass(frozen=True)
class Companion:
    """The second group of callers; ``connections`` 0: the primary group alone."""

    connections: int = 0
    criticality: str = ""
    honour_retry_after: bool = False
    overloaded_pause_s: float = 0.0
    caller: str = ""  # RequestMeta.caller ("": the anonymous caller)
    #: What a whole answer is: every panel OK ("stats"), or the essential ones.
    call: str = "stats"


def run_mixed(
    config: Any, timing: Any, result: dict[str, Any], on_window: Callable[[], None], runner: Any
) -> None:
    """Measure ``config`` (a :class:`~bench.harness.runner.Config` with a companion) into
    ``result``: the primary group's windows as usual, the companion's, the levels.

    ``runner`` is what measures one group (``plan_of``, ``measure``, ``loadgen_processes``
    of :mod:`bench.harness.runner`, which passes itself), so that this module imports
    nothing of the runner that calls it."""
    from bench.harness.stack import start_stack
    from bench.load.loadgen import LoadGenerator

    companion: Companion = config.companion
    with start_stack(config.spec) as stack:
        levels = _LevelSampler(stack.address).start()
        second: dict[str, Any] = {}
        ready = threading.Event()
        thread = None
        if companion.connections:
            plan = dataclasses.replace(
                runner.plan_of(_as_primary(config, companion), stack.address, timing),
                warmup_s=timing.warmup_s + 1.0,
            )
            thread = threading.Thread(
                target=_run_companion, args=(plan, second, ready), daemon=True
            )
            thread.start()
            ready.wait(timeout=120)
        with LoadGenerator(runner.loadgen_processes(config.connections)) as generator:
            runner.measure(config, stack, generator, timing, result, on_window)
        if thread is not None:
            thread.join(timeout=timing.warmup_s + timing.window_s * timing.reps + 120)
        levels.stop()
        result["brownout_levels"] = levels.levels
        result["admission_samples"] = levels.admission
        result["companion"] = _summary(second.get("load"), timing) if second else {}
        if "error" in second:
            result["companion"]["error"] = second["error"]
    result["essential"] = _essential(result.pop("samples", []), timing)


def _as_primary(config: Any, companion: Companion) -> Any:
    return dataclasses.replace(
        config,
        call=companion.call,
        caller=companion.caller,
        connections=companion.connections,
        criticality=companion.criticality,
        honour_retry_after=companion.honour_retry_after,
        decode_every=0,
        overloaded_pause_s=companion.overloaded_pause_s,
        companion=None,
        interval_s=0.0,  # a closed loop, whatever pace the primary group keeps
        open_loop=False,
    )


def _run_companion(plan: Any, out: dict[str, Any], ready: threading.Event) -> None:
    from bench.load.loadgen import LoadGenerator

    try:
        with LoadGenerator(plan.processes) as generator:
            out["load"] = generator.run(plan, on_ready=ready.set)
    except Exception as exc:  # the primary's figures still stand; say what went wrong
        out["error"] = f"{type(exc).__name__}: {exc}"
        ready.set()


def _summary(load: Any | None, timing: Any) -> dict[str, Any]:
    """The companion's replies per window: whole (every panel OK), lighter, failures."""
    if load is None:
        return {}
    windows = [
        {"whole": sum(w.ok), "lighter": sum(w.degraded), "failures": dict(w.failures)}
        for w in load.windows
    ]
    return {
        "connected": load.connected,
        "windows": windows,
        "whole_per_s": sum(w["whole"] for w in windows) / (timing.window_s * len(windows)),
        "refused": sum(w["failures"].get("overloaded", 0) for w in windows),
        "late": sum(w["failures"].get("timeout", 0) for w in windows),
        "monitor_cut": load.monitor_cut,
    }


def _essential(samples: list[dict[str, Any]], timing: Any) -> dict[str, Any]:
    """From every decoded reply of the primary group: per window, the calls whose essential
    panels were all OK, and the optional panels those calls ran."""
    from bench.harness.calls import panel_names

    names = set(panel_names())
    essential, optional = names - SHIPPED_OPTIONAL, names & SHIPPED_OPTIONAL
    per_window: dict[int, list[int]] = {}
    for sample in samples:
        ok = set(sample["outcomes_ms"])
        counts = per_window.setdefault(sample["window"], [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += essential <= ok
        counts[2] += len(optional & ok)
        counts[3] += names <= ok
    windows = [per_window.get(w, [0, 0, 0, 0]) for w in range(timing.reps)]
    return {
        "per_s": [w[1] / timing.window_s for w in windows],
        "answers": [w[0] for w in windows],
        "essential_ok": [w[1] for w in windows],
        "whole": [w[3] for w in windows],
        "optional_run": [w[2] for w in windows],
        "optional_asked": [w[0] * len(optional) for w in windows],
    }


class _LevelSampler:
    """Reads the server's brownout level every half second in a thread of its own."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address
        self.levels: list[tuple[float, float]] = []
        self.admission: list[tuple[int, int, int]] = []  # limit, in flight, queued
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _LevelSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from thriftpy2.protocol import TBinaryProtocolFactory
        from thriftpy2.rpc import make_client
        from thriftpy2.transport import TFramedTransportFactory

        from service.idl import appstats

        started = time.monotonic()
        client = None
        while not self._stop.wait(_LEVEL_POLL_S):
            try:
                if client is None:
                    client = make_client(
                        appstats.AppStats,
                        *self._address,
                        timeout=3000,
                        trans_factory=TFramedTransportFactory(),
                        proto_factory=TBinaryProtocolFactory(),
                    )
                report = client.pool_stats()
                self.levels.append(
                    (round(time.monotonic() - started, 2), report.brownout_level or 0.0)
                )
                self.admission.append(
                    (report.admission_limit, report.calls_in_flight, report.calls_queued)
                )
            except Exception:
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()
