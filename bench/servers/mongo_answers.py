"""Aggregation answers recorded from nx-27017, keyed by collection and pipeline shape.

The file ``bench/fixtures/mongo_answers.json`` (written by ``python -m bench.record_mongo``)
holds, for each MongoDB lookup, the stages its pipeline has after the leading ``$match``
and the documents nx-27017 answered for the benchmark's sample call. The key leaves out
the ``$match``, so the app and the window do not matter: the benchmark always makes the
same call, and the four lookups differ in their later stages (``urls`` and
``controllers`` share a collection but group on different fields)::

    {"recorded_from": "...", "database": "apm",
     "call": {"app": "shop", "start_ms": ..., "end_ms": ...},
     "answers": [{"lookup": "errors", "collection": "errors",
                  "stages": [...], "documents": [...]}, ...]}

The JSON is MongoDB Extended JSON (relaxed), read and written with ``bson.json_util``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bson import json_util

__all__ = [
    "DEFAULT_ANSWERS_PATH",
    "RecordedAnswer",
    "RecordedAnswers",
    "pipeline_key",
    "stages_after_match",
]

DEFAULT_ANSWERS_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "mongo_answers.json"


def stages_after_match(pipeline: Sequence[Any]) -> list[Any]:
    """``pipeline`` without its leading ``$match`` stage (the app and the window)."""
    stages = list(pipeline)
    if stages and isinstance(stages[0], Mapping) and "$match" in stages[0]:
        return stages[1:]
    return stages


def pipeline_key(collection: str, stages: Sequence[Any]) -> str:
    """The lookup key: the collection and the stages as Extended JSON, in their own key order.

    Key order is kept, not sorted: in ``$sort`` it is part of the meaning.
    """
    return f"{collection}\n{json_util.dumps(list(stages))}"


@dataclass(frozen=True)
class RecordedAnswer:
    """What one lookup's aggregation answered: its ``cursor.firstBatch`` documents."""

    lookup: str
    collection: str
    stages: list[Any]
    documents: list[Any]

    @property
    def key(self) -> str:
        return pipeline_key(self.collection, self.stages)


@dataclass
class RecordedAnswers:
    """A set of recorded answers and what they were recorded from."""

    answers: list[RecordedAnswer]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_key = {answer.key: answer for answer in self.answers}

    def documents_for(self, collection: str, stages: Sequence[Any]) -> list[Any] | None:
        """The recorded documents for this collection and these stages, or ``None``."""
        answer = self._by_key.get(pipeline_key(collection, stages))
        return None if answer is None else answer.documents

    def lookups(self) -> list[str]:
        return [answer.lookup for answer in self.answers]

    @classmethod
    def load(cls, path: str | Path = DEFAULT_ANSWERS_PATH) -> RecordedAnswers:
        """Read a fixture file. Raises ``OSError`` if unreadable, ``ValueError`` if malformed."""
        document = json_util.loads(Path(path).read_text(encoding="utf-8"))
        try:
            answers = [
                RecordedAnswer(
                    lookup=item["lookup"],
                    collection=item["collection"],
                    stages=list(item["stages"]),
                    documents=list(item["documents"]),
                )
                for item in document["answers"]
            ]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a recorded-answers file ({exc!r})") from None
        meta = {key: value for key, value in document.items() if key != "answers"}
        return cls(answers, meta)

    def save(self, path: str | Path) -> None:
        """Write the fixture file: relaxed Extended JSON, one recorded document per line."""

        def compact(value: Any) -> str:
            return json_util.dumps(value, json_options=json_util.RELAXED_JSON_OPTIONS)

        meta = [f" {compact(key)}: {compact(value)}," for key, value in self.meta.items()]
        answers = []
        for answer in self.answers:
            documents = ",\n".join(f"    {compact(d)}" for d in answer.documents)
            answers.append(
                f'  {{"lookup": {compact(answer.lookup)}, '
                f'"collection": {compact(answer.collection)},\n'
                f'   "stages": {compact(answer.stages)},\n'
                f'   "documents": [\n{documents}\n   ]}}'
            )
        text = "{\n" + "\n".join(meta) + '\n "answers": [\n' + ",\n".join(answers) + "\n ]\n}\n"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")

    @classmethod
    def of(cls, answers: Iterable[RecordedAnswer], **meta: Any) -> RecordedAnswers:
        return cls(list(answers), dict(meta))
