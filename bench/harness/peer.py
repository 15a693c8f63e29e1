"""The peer scenario: Fanout beside what a team would write on asyncio today.

Fanout, the asyncio peer (:mod:`bench.baselines.asyncio_peer`: uvloop, thriftpy2's asyncio
server, pymongo's ``AsyncMongoClient``, aiohttp) and the hand-written gevent server, in
turn, a few rounds each (:mod:`bench.harness.rounds`), at one connection and at a closed
loop of 50. The light backends answer after 20 ms; Fanout's dimmer is off, so that every
call it counts is the whole work the peers do. Per server: CPU per call, complete calls a second and p50.
"""

from __future__ import annotations

import functools

from bench.analysis.goals import Goal, info_row, ratio_goal
from bench.harness.rounds import interleaved, merged, round_label, round_ratios_shown, rounds_of
from bench.harness.runner import Config
from bench.harness.scenario import (
    Results,
    Scale,
    Scenario,
    _config,
    _cpu_ms_per_reply,
    _per_rep,
    result_key,
    rps_and_cpu_goals,
)

__all__ = ["asyncio_peer"]

NAME = "peer"
ROUNDS = 3
LEVELS = (1, 50)  # 50: the connections of the peer's independent measurement
SERVERS = ("fanout", "asyncio", "handwritten")


def _mode(server: str, connections: int, n: int, share: float) -> Config:
    whole = {"brownout": False} if server == "fanout" else {}
    return _config(
        NAME,
        server,
        "stats",
        connections,
        label=round_label(server, n),
        reps_share=share,
        **whole,
    )


def _ratio_rows(results: Results, connections: int, over: str, under: str) -> list[Goal]:
    key = functools.partial(result_key, NAME, connections=connections)
    top, bottom = rounds_of(results, key, over, ROUNDS), rounds_of(results, key, under, ROUNDS)
    at = f"{connections} connection{'s' if connections > 1 else ''}"
    saturated = connections > 1
    limit = 1.0 if saturated and under == "asyncio" else None
    return [
        *rps_and_cpu_goals(
            NAME,
            (
                f"complete calls a second, {over} / {under}, {at}",
                f"server CPU per call, {over} / {under}, {at}",
            ),
            merged(top),
            merged(bottom),
            (limit, limit),
        ),
        info_row(
            NAME,
            f"server CPU per call, {over} / {under}, each round ({at})",
            round_ratios_shown(top, bottom, _cpu_ms_per_reply),
        ),
        ratio_goal(
            NAME,
            f"p50, {over} / {under}, {at}",
            _per_rep(merged(top), "p50_ms"),
            _per_rep(merged(bottom), "p50_ms"),
            limit=None if saturated else 1.05,
            at_most=True,
        ),
    ]


def _commands_per_call(results: Results, connections: int) -> Goal:
    """The MongoDB commands each server sent per call it answered (the responder counts
    them), over its rounds: what collapsing lookups would lower."""
    key = functools.partial(result_key, NAME, connections=connections)
    shown = []
    for server in SERVERS:
        values = [
            rep["mongo_commands_per_reply"]
            for result in rounds_of(results, key, server, ROUNDS)
            for rep in (result or {}).get("reps", [])
            if rep.get("mongo_commands_per_reply") is not None
        ]
        figure = f"{sum(values) / len(values):.2f}" if values else "n/a"
        shown.append(f"{server} {figure}")
    return info_row(
        NAME,
        f"MongoDB commands per call answered, {connections} connection(s) (batch size 1)",
        ", ".join(shown),
    )


def _goals(results: Results) -> list[Goal]:
    return [
        goal
        for connections in LEVELS
        for goal in (
            *(
                row
                for under in ("asyncio", "handwritten")
                for row in _ratio_rows(results, connections, "fanout", under)
            ),
            _commands_per_call(results, connections),
        )
    ]


def asyncio_peer(scale: Scale) -> Scenario:
    configs = [
        config
        for connections in LEVELS
        for config in interleaved(
            1 if scale.quick else ROUNDS,
            *(functools.partial(_mode, server, connections) for server in SERVERS),
        )
    ]
    notes = [
        f"{', '.join(SERVERS)} in turn, {ROUNDS} rounds each, at "
        f"{', '.join(map(str, LEVELS))} connection(s); 7 lookups a call, 20 ms backends; "
        "Fanout's dimmer off. asyncio = bench/baselines/asyncio_peer.py: uvloop, "
        "thriftpy2's asyncio server (framed, binary), pymongo's AsyncMongoClient, one "
        "aiohttp session, a task per lookup; its versions are in machine.packages."
    ]
    return Scenario(NAME, "Fanout beside an asyncio peer", configs, _goals, notes)
