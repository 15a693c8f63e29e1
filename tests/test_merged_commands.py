"""``fanout.merge_commands``: the urls and controllers panels by one MongoDB command
(:class:`lookups.mongo.RequestTopsCommand`, :mod:`service.rpc.merged`), on the real
MongoDB-wire server over the sample data: the same answers as the two commands it
replaces, for every window, and one command a call where there were two."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
from opentelemetry.trace import SpanKind

from lookups.backends.collection import Backends
from lookups.deadline import Deadline
from lookups.mongo import ControllersLookup, RequestTopsCommand, UrlsLookup
from lookups.panels import Window
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS, SampleData

APPS = ["shop", "search", "billing", "no-such-app"]
PATIENT_MS = 10_000


def windows(data: SampleData, count: int, seed: int = 7) -> list[Window]:
    """``count`` windows over the sample day, of any app and length, edges on records and
    between them, the whole day and an empty one among them."""
    chosen = random.Random(seed)
    stamps = sorted({r.ts_ms for r in data.requests})
    found = [Window("shop", SAMPLE_START_MS, SAMPLE_END_MS), Window("shop", 0, 1)]
    while len(found) < count:
        start, end = sorted(chosen.sample(stamps, 2))
        found.append(Window(chosen.choice(APPS), start + chosen.choice((0, 1)), end))
    return found


def test_one_command_answers_exactly_what_the_two_did(
    backends: Backends, sample_data: SampleData
) -> None:
    mongo = backends.mongo()
    command, urls, controllers = (
        RequestTopsCommand(mongo),
        UrlsLookup(mongo),
        ControllersLookup(mongo),
    )
    for window in windows(sample_data, 40):
        tops = command.fetch(window, Deadline.after_s(10))
        assert tops.urls == urls.fetch(window, Deadline.after_s(10)), window
        assert tops.controllers == controllers.fetch(window, Deadline.after_s(10)), window


def requests_commands(spans: Any) -> int:
    return sum(
        1
        for span in spans.get_finished_spans()
        if span.kind is SpanKind.CLIENT and span.name == "aggregate requests"
    )


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_call_sends_one_command_for_both_panels_and_answers_as_before(
    start_service: Any, spans: Any, coalesce: bool
) -> None:
    """With request coalescing off, the call shares the command all the same. A patient
    budget: nx-27017's `$facet` is slow, and beside two CPU hogs the panels outran 1 s."""
    answers, commands = {}, {}
    for merge in (False, True):
        _, client = start_service(
            fanout__merge_commands=merge,
            fanout__coalesce=coalesce,
            fanout__task_timeout_ms=PATIENT_MS,
            fanout__request_deadline_ms=PATIENT_MS,
        )
        call = functools.partial(
            client.get_app_stats, "shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=PATIENT_MS
        )
        call()  # connections warm
        spans.clear()
        response = call()
        commands[merge] = requests_commands(spans)
        answers[merge] = response
    assert commands == {False: 2, True: 1}
    assert {o.name: o.status for o in answers[True].outcomes} == {
        o.name: o.status for o in answers[False].outcomes
    }
    for panel in ("urls", "controllers"):
        assert answers[True].panels[panel] == answers[False].panels[panel]
        assert answers[True].panels[panel].top_list.entries
