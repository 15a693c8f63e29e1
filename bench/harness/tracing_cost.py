"""The tracing scenario: what tracing costs a call, sampled at 1%, at 10%, and every call,
with tail capture (as shipped), and at 1% and every call with head sampling alone; and at
1% against off again with about 5% of calls failing a panel (:data:`FAILING`), whose
traces tail capture keeps and exports.

A closed loop at :data:`SATURATING_CONNECTIONS` connections keeps the server's CPU busy,
so tracing's CPU shows as lost calls a second as well as CPU per call. The modes
(``off``, :data:`TRACING_LIMITS`'s and :data:`HEAD_ONLY`) run in turn, a few rounds each
(:mod:`bench.harness.rounds`): run one after the other, the machine's drift from one
minute to the next weighed as much as a 1% sampler does, and the first mode run looked
the cheapest. Each mode's rounds are merged back into one result for its goals.
"""

from __future__ import annotations

import functools

from bench.analysis.goals import Goal, info_row
from bench.harness.rounds import (
    interleaved,
    merged,
    round_label,
    round_ratios_shown,
    rounds_of,
)
from bench.harness.runner import Config
from bench.harness.scenario import (
    SATURATING_CONNECTIONS,
    Results,
    Scale,
    Scenario,
    _config,
    _cpu_ms_per_reply,
    rps_and_cpu_goals,
)

__all__ = ["TRACING_LIMITS", "tracing_cost"]

NAME = "tracing"
ROUNDS = 3

#: Each traced mode's goals against tracing off: the least calls/s, the most CPU per call.
TRACING_LIMITS = {"ratio1": (0.95, 1.05), "ratio10": (0.95, 1.05), "full": (0.75, 1.30)}
#: The same ratios without tail capture (``tracing.tail_capture = false``): what it costs
#: or saves, against its mode in the same rounds.
HEAD_ONLY = {"ratio1": "ratio1-head", "full": "full-head"}
#: Modes whose HTTP services fail every :data:`FAIL_EVERY`-th request, by the tracing mode
#: each runs; ``failing-ratio1`` / ``failing-off``: at most :data:`FAILING_LIMIT`.
FAILING = {"failing-off": "off", "failing-ratio1": "ratio1"}
#: A call makes three HTTP requests (alerts; the metrics service twice), so about 5% of
#: calls have a panel failed.
FAIL_EVERY = 60
FAILING_LIMIT = (0.92, 1.08)
_MODES = ("off", *TRACING_LIMITS, *HEAD_ONLY.values(), *FAILING)


def _mode(mode: str, n: int, share: float) -> Config:
    return _config(
        NAME,
        "fanout",
        "stats",
        SATURATING_CONNECTIONS,
        label=round_label(f"tracing-{mode}", n),
        tracing=FAILING.get(mode, mode),
        http_fail_every=FAIL_EVERY if mode in FAILING else 0,
        reps_share=share,
    )


def _key(label: str) -> str:
    return f"{NAME}/{label}/c{SATURATING_CONNECTIONS}"


def _goals(results: Results) -> list[Goal]:
    rounds = {mode: rounds_of(results, _key, f"tracing-{mode}", ROUNDS) for mode in _MODES}
    off = merged(rounds["off"])
    out: list[Goal] = []
    for mode, (least, most) in TRACING_LIMITS.items():
        traced = merged(rounds[mode])
        out += rps_and_cpu_goals(
            NAME,
            (
                f"RPS tracing {mode} / off (loss at most {100 * (1 - least):.0f}%)",
                f"server CPU per call, tracing {mode} / off (at most +{100 * (most - 1):.0f}%)",
            ),
            traced,
            off,
            (least, most),
        )
        out.append(
            info_row(
                NAME,
                f"server CPU per call, tracing {mode} / off, each round in turn",
                round_ratios_shown(rounds[mode], rounds["off"], _cpu_ms_per_reply),
            )
        )
    out += rps_and_cpu_goals(
        NAME,
        (
            "RPS tracing ratio1 / off, 5% of calls failing a panel "
            f"(loss at most {100 * (1 - FAILING_LIMIT[0]):.0f}%)",
            "server CPU per call, tracing ratio1 / off, 5% of calls failing a panel "
            f"(at most +{100 * (FAILING_LIMIT[1] - 1):.0f}%)",
        ),
        merged(rounds["failing-ratio1"]),
        merged(rounds["failing-off"]),
        FAILING_LIMIT,
    )
    out.append(
        info_row(
            NAME,
            "server CPU per call, tracing ratio1 / off, 5% of calls failing, each round in turn",
            round_ratios_shown(rounds["failing-ratio1"], rounds["failing-off"], _cpu_ms_per_reply),
        )
    )
    for mode, head in HEAD_ONLY.items():
        out.append(
            info_row(
                NAME,
                f"server CPU per call, {mode}: tail capture / head sampling alone, "
                "each round in turn",
                round_ratios_shown(rounds[mode], rounds[head], _cpu_ms_per_reply),
            )
        )
    return out


def tracing_cost(scale: Scale) -> Scenario:
    """Tracing off, and at each of :data:`TRACING_LIMITS`'s modes, in turn."""
    configs = interleaved(
        1 if scale.quick else ROUNDS,
        *(functools.partial(_mode, mode) for mode in _MODES),
    )
    notes = [
        f"Closed loop at {SATURATING_CONNECTIONS} connections: enough to keep the server's "
        "CPU busy (so tracing's CPU shows as lost throughput), few enough that no lookup "
        "runs into its 1 s timeout. ratio1 and ratio10 = 1% and 10% parent-based sampling, "
        "full = 100%, each with tail capture as shipped (calls not sampled at the head are "
        "recorded, and kept only if they failed, were cut or were slow); ratio1-head and "
        "full-head: the same without tail capture; failing-off and failing-ratio1: off and 1% "
        f"again, with every {FAIL_EVERY}th request of each HTTP service answered with a body "
        "cut short (about 5% of calls fail a panel). Batch processor, OTLP/HTTP export to a "
        f"local sink (its CPU is in the otlp column). The modes run in turn, {ROUNDS} rounds "
        "each."
    ]
    return Scenario(NAME, "Tracing cost", configs, _goals, notes)
