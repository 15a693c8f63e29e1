"""The merged-commands scenario: what ``fanout.merge_commands`` saves a call.

The urls and controllers panels by one MongoDB command instead of two
(:mod:`service.rpc.merged`), against the real MongoDB-wire server (nx-27017, its
answers computed, not replayed: the responder knows only the recorded pipelines), with
the dimmer off so that every call does the whole work. Off and on run in turn, a few
rounds each (:mod:`bench.harness.rounds`), at one connection and at a closed loop of
:data:`~bench.harness.scenario.SATURATING_CONNECTIONS`: the server's CPU per call, and
complete calls a second.
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
    result_key,
    rps_and_cpu_goals,
)

__all__ = ["merged_commands"]

NAME = "merge"
ROUNDS = 3
LEVELS = (1, SATURATING_CONNECTIONS)


def _mode(connections: int, on: bool, n: int, share: float) -> Config:
    return _config(
        NAME,
        "fanout",
        "stats",
        connections,
        label=round_label("merged" if on else "separate", n),
        mongo="nx",
        brownout=False,
        merge_commands=on,
        reps_share=share,
    )


def _goals(results: Results) -> list[Goal]:
    out: list[Goal] = []
    for connections in LEVELS:
        key = functools.partial(result_key, NAME, connections=connections)
        on = rounds_of(results, key, "merged", ROUNDS)
        off = rounds_of(results, key, "separate", ROUNDS)
        out += [
            *rps_and_cpu_goals(
                NAME,
                (
                    f"complete calls a second, one command / two, {connections} connection(s)",
                    f"server CPU per call, one command / two, {connections} connection(s)",
                ),
                merged(on),
                merged(off),
            ),
            info_row(
                NAME,
                f"server CPU per call, one command / two, each round ({connections})",
                round_ratios_shown(on, off, _cpu_ms_per_reply),
            ),
        ]
    return out


def merged_commands(scale: Scale) -> Scenario:
    configs = [
        config
        for connections in LEVELS
        for config in interleaved(
            1 if scale.quick else ROUNDS,
            functools.partial(_mode, connections, False),
            functools.partial(_mode, connections, True),
        )
    ]
    notes = [
        "fanout.merge_commands off (two commands for urls and controllers) and on (one "
        f"$facet), in turn, {ROUNDS} rounds each, at {', '.join(map(str, LEVELS))} "
        "connection(s); nx-27017 as the MongoDB server; dimmer off."
    ]
    return Scenario(NAME, "One command for two panels", configs, _goals, notes)
