"""The group's counters across worker lifetimes: a position's counts never go back.

In the merged scrape (``service.workers.group``) a position's counter and histogram
series are the sum over every worker that has held that position:

* the workers serving now, each at its latest scrape; after a reload the old worker
  is scraped beside the new one until it has handed its connections over and gone;
* the workers gone, each at its last counts: those it sent once its drain was over
  (``counts`` on the control line), or, for one killed without a word, its last scrape.

So a reload, a retirement or a restart is no counter reset, and ``increase()`` over it
equals the calls answered, except what a killed worker answered after its last
scrape. Gauges say what is true now: the newest worker's, or while a position has no
worker answering, its last answer given again (``fanout_worker_scraped`` says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["GroupCounts"]

#: The family types whose samples only ever grow, and so are summed across lifetimes.
_CUMULATIVE = frozenset({"counter", "histogram"})

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)
_Family = tuple[str, str, str, str]  # (name, help, type, unit)


@dataclass
class _Parsed:
    """One exposition: each family's header and, by sample, its value."""

    families: dict[str, _Family] = field(default_factory=dict)
    samples: dict[str, dict[_SampleKey, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, text: str) -> _Parsed:
        parsed = cls()
        for family in text_string_to_metric_families(text):
            parsed.families[family.name] = (
                family.name,
                family.documentation,
                family.type,
                family.unit,
            )
            parsed.samples[family.name] = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for sample in family.samples
                if not sample.name.endswith("_created")  # a lifetime's start: not summed
            }
        return parsed

    def add(self, other: _Parsed, cumulative: bool) -> None:
        """Add ``other``'s cumulative families (counters, histograms), or its others."""
        for name, header in other.families.items():
            if (header[2] in _CUMULATIVE) != cumulative:
                continue
            self.families.setdefault(name, header)
            into = self.samples.setdefault(name, {})
            for key, value in other.samples[name].items():
                into[key] = into.get(key, 0.0) + value


@dataclass
class _Worker:
    position: str
    last: _Parsed
    final: _Parsed | None = None


class GroupCounts:
    """Every running worker's latest counts, and each position's gone workers' totals.

    A worker is named by its serial number, which the master never gives twice.
    """

    def __init__(self) -> None:
        self._workers: dict[int, _Worker] = {}  # by serial: the running ones
        self._exited: set[int] = set()  # serials gone: a scrape answered late is not counted
        self._gone: dict[str, _Parsed] = {}  # by position: the sum of its gone workers
        self._held: dict[str, tuple[int, _Parsed]] = {}  # by position: newest answer, serial

    def scraped(self, serial: int, position: str, text: str) -> None:
        """Worker ``serial``, holding ``position``, answered a scrape with ``text``."""
        if serial in self._exited:
            return
        parsed = _Parsed.of(text)
        self._workers.setdefault(serial, _Worker(position, parsed)).last = parsed
        held = self._held.get(position)
        if held is None or held[0] <= serial:
            self._held[position] = (serial, parsed)

    def final(self, serial: int, position: str, text: str) -> None:
        """Worker ``serial`` has drained: ``text`` is its last exposition, counted at its exit."""
        if serial in self._exited:
            return
        parsed = _Parsed.of(text)
        self._workers.setdefault(serial, _Worker(position, parsed)).final = parsed

    def exited(self, serial: int) -> None:
        """Worker ``serial`` has gone: its last counts join its position's totals for good."""
        self._exited.add(serial)
        worker = self._workers.pop(serial, None)
        if worker is None:
            return  # never scraped, so never counted: nothing to keep
        gone = self._gone.setdefault(worker.position, _Parsed())
        gone.add(worker.final or worker.last, cumulative=True)

    def positions(self) -> set[str]:
        """Every position with series: held now, or held once by a worker now gone."""
        return set(self._held) | set(self._gone)

    def merged(self, position: str) -> _Parsed:
        """``position``'s series: counts summed over its workers, gauges from the newest."""
        merged = _Parsed()
        held = self._held.get(position)
        if held is not None:
            merged.add(held[1], cumulative=False)
        for worker in self._workers.values():
            if worker.position == position:
                merged.add(worker.last, cumulative=True)
        if position in self._gone:
            merged.add(self._gone[position], cumulative=True)
        return merged

    def families(self, label: str = "worker") -> list[Metric]:
        """Every position's series as metric families, each sample labelled ``label``."""
        families: dict[str, Metric] = {}
        for position in sorted(self.positions()):
            merged = self.merged(position)
            for name, (_, documentation, kind, unit) in merged.families.items():
                family = families.setdefault(name, Metric(name, documentation, kind, unit))
                for (sample, labels), value in merged.samples[name].items():
                    family.add_sample(sample, {**dict(labels), label: position}, value)
        return list(families.values())
