"""The group's counters across worker lifetimes: a position's counts never go back.

In the merged scrape (``service.workers.group``) a position's counter and histogram
series are the sum over every worker that has held that position:

* the workers serving now, each at its latest scrape; after a reload the old worker
  is scraped beside the new one until it has handed its connections over and gone;
* the workers gone, each at its last counts: those it sent once its drain was over
  (``counts`` on the control line), or, for one killed without a word, its last scrape;
  and its calls' histogram as the file it kept them in has it
  (:mod:`service.workers.kept_calls`), which has every call it recorded.

So a reload, a retirement or a restart is no counter reset, and ``increase()`` of the
calls over it equals the calls answered, a killed worker's included (give or take the
calls it had in flight); its other counters count as of its last scrape. Gauges say
what is true now: the newest worker's, or while a position has no worker answering, its
last answer given again (``fanout_worker_scraped`` says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.workers.exposition import Exposition, parse_exposition, render_expositions
from service.workers.kept_calls import with_kept_calls
from tracing.call_tally import TalliedCalls

__all__ = ["GroupCounts"]


@dataclass
class _Worker:
    position: str
    last: Exposition
    final: Exposition | None = None


class GroupCounts:
    """Every running worker's latest counts, and each position's gone workers' totals.

    A worker is named by its serial number, which the master never gives twice.
    """

    def __init__(self) -> None:
        self._workers: dict[int, _Worker] = {}  # by serial: the running ones
        self._exited: set[int] = set()  # serials gone: a scrape answered late is not counted
        self._gone: dict[str, Exposition] = {}  # by position: the sum of its gone workers
        self._held: dict[str, tuple[int, Exposition]] = {}  # by position: newest answer, serial

    def scraped(self, serial: int, position: str, text: str) -> None:
        """Worker ``serial``, holding ``position``, answered a scrape with ``text``."""
        if serial in self._exited:
            return
        parsed = parse_exposition(text)
        self._workers.setdefault(serial, _Worker(position, parsed)).last = parsed
        held = self._held.get(position)
        if held is None or held[0] <= serial:
            self._held[position] = (serial, parsed)

    def final(self, serial: int, position: str, text: str) -> None:
        """Worker ``serial`` has drained: ``text`` is its last exposition, counted at its exit."""
        if serial in self._exited:
            return
        parsed = parse_exposition(text)
        self._workers.setdefault(serial, _Worker(position, parsed)).final = parsed

    def exited(self, serial: int, position: str, calls: Sequence[TalliedCalls] = ()) -> None:
        """Worker ``serial``, which held ``position``, has gone: its last counts, with the
        ``calls`` it kept, join its position's totals for good."""
        self._exited.add(serial)
        worker = self._workers.pop(serial, None)
        last = Exposition() if worker is None else worker.final or worker.last
        others = [other.last for other in self._workers.values()] + list(self._gone.values())
        last = with_kept_calls(last, calls, others)
        if last.samples:
            self._gone.setdefault(position, Exposition()).add(last, cumulative=True)

    def positions(self) -> set[str]:
        """Every position with series: held now, or held once by a worker now gone."""
        return set(self._held) | set(self._gone)

    def merged(self, position: str) -> Exposition:
        """``position``'s series: counts summed over its workers, gauges from the newest."""
        merged = Exposition()
        held = self._held.get(position)
        if held is not None:
            merged.add(held[1], cumulative=False)
        for worker in self._workers.values():
            if worker.position == position:
                merged.add(worker.last, cumulative=True)
        if position in self._gone:
            merged.add(self._gone[position], cumulative=True)
        return merged

    def exposition(self, label: str = "worker") -> str:
        """Every position's series as one text exposition, each sample labelled ``label``."""
        return render_expositions(
            {position: self.merged(position) for position in sorted(self.positions())}, label
        )
