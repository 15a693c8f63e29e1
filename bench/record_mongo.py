"""Record the answers the benchmark's MongoDB-wire responder replays.

Starts nx-27017 (:class:`service.samples.MongoWireServer`), seeds it with the sample
data, runs every MongoDB lookup of the default registry once for the benchmark's
sample call (:func:`bench.harness.calls.sample_call`), captures each aggregation's reply
documents through pymongo's command monitoring, and writes them as Extended JSON::

    python -m bench.record_mongo [--out bench/fixtures/mongo_answers.json]

Run it again whenever a MongoDB lookup's pipeline or the sample data changes; the
test ``tests/test_bench_responder.py`` fails until the fixture matches.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

from pymongo import monitoring

from bench.servers.mongo_answers import (
    DEFAULT_ANSWERS_PATH,
    RecordedAnswer,
    RecordedAnswers,
    stages_after_match,
)
from lookups.backends.collection import Backends
from lookups.deadline import Deadline
from lookups.panels import Window
from lookups.registry import default_registry
from service.samples import DEFAULT_SEED, MongoWireServer, generate_sample_data, seed_mongo_at
from service.settings.config import load_settings

__all__ = ["AggregateRecorder", "record_answers", "main"]

_DATABASE = "apm"
_TIMEOUT_S = 30.0


class AggregateRecorder(monitoring.CommandListener):
    """Keeps the pipeline and the first batch of every successful ``aggregate``."""

    def __init__(self) -> None:
        self._pipelines: dict[int, tuple[str, list[Any]]] = {}
        self.recorded: list[tuple[str, list[Any], list[Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "aggregate":
            command = event.command
            self._pipelines[event.request_id] = (
                command["aggregate"],
                copy.deepcopy(list(command["pipeline"])),
            )

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pipeline = self._pipelines.pop(event.request_id, None)
        if pipeline is not None:
            collection, stages = pipeline
            cursor = event.reply["cursor"]
            if cursor.get("id"):
                raise RuntimeError(f"{collection}: the answer did not fit one batch")
            self.recorded.append((collection, stages, copy.deepcopy(list(cursor["firstBatch"]))))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._pipelines.pop(event.request_id, None)


def record_answers(window: Window, seed: int = DEFAULT_SEED) -> RecordedAnswers:
    """Run the MongoDB lookups for ``window`` against a freshly seeded nx-27017.

    Raises :class:`service.samples.MongoWireServerError` if nx-27017 cannot start,
    :class:`lookups.errors.LookupFailed` if a lookup fails, and ``RuntimeError`` if a
    lookup runs other than exactly one aggregation or its answer needs a second batch.
    """
    recorder = AggregateRecorder()
    # Global listeners apply to clients created afterwards: the lookups' own client.
    monitoring.register(recorder)
    answers = []
    with MongoWireServer() as server:
        seed_mongo_at(server.uri, _DATABASE, generate_sample_data(seed))
        settings = load_settings(
            env={}, overrides={"mongo.uri": server.uri, "mongo.database": _DATABASE}
        )
        with Backends(settings.backends) as backends:
            for name, lookup in default_registry().build(backends).items():
                if lookup.source != "mongo":
                    continue
                before = len(recorder.recorded)
                lookup.fetch(window, Deadline.after_s(_TIMEOUT_S))
                if len(recorder.recorded) != before + 1:
                    raise RuntimeError(
                        f"{name}: expected one aggregation, saw {len(recorder.recorded) - before}"
                    )
                collection, pipeline, documents = recorder.recorded[-1]
                answers.append(
                    RecordedAnswer(name, collection, stages_after_match(pipeline), documents)
                )
    return RecordedAnswers.of(
        answers,
        recorded_from=f"nx-27017 seeded with service.samples.seed (seed {seed})",
        database=_DATABASE,
        call={"app": window.app, "start_ms": window.start_ms, "end_ms": window.end_ms},
    )


def main(argv: list[str] | None = None) -> int:
    from bench.harness.calls import sample_call

    parser = argparse.ArgumentParser(
        prog="python -m bench.record_mongo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=str(DEFAULT_ANSWERS_PATH))
    args = parser.parse_args(argv)
    answers = record_answers(Window(*sample_call()))
    answers.save(args.out)
    sizes = ", ".join(f"{a.lookup} {len(a.documents)}" for a in answers.answers)
    print(f"wrote {Path(args.out)}: {sizes} documents", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
