"""A gone worker's calls as it kept them (:mod:`tracing.call_tally`), as series of its scrape.

When a worker has gone, its calls' histogram (``rpc_server_call_duration_seconds``) is
taken from the file it kept them in wherever that says more than its last counts: a
worker killed without a word answered calls after the master's last scrape of it, and
the file has every one. The series are written as the OpenTelemetry Prometheus exporter
writes them: the labels of a series the family has already (the scope's,
``rpc_system_name``) with the call's ``rpc_method`` and ``error_type``, in name order, a
label with an empty value left out as :func:`~service.workers.exposition.parse_exposition`
leaves it out; ``le`` as the text format writes a bound.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator, Sequence

from service.workers.exposition import Exposition, escaped, go_float
from tracing.call_tally import TalliedCalls
from tracing.metrics import SECONDS_BUCKETS

__all__ = ["CALLS", "with_kept_calls"]

#: The calls' histogram, as the exporter names it.
CALLS = "rpc_server_call_duration_seconds"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_OWN_LABELS = frozenset({"le", "rpc_method", "error_type"})  # a series' own, not the family's


def with_kept_calls(
    counts: Exposition, calls: Sequence[TalliedCalls], others: Iterable[Exposition]
) -> Exposition:
    """``counts`` with its calls' series as ``calls`` has them, where that is more.

    The family's header and common labels come from ``counts``, or, if it has no call yet,
    from ``others`` (the group's other expositions); with none anywhere, nothing can be
    written as the exporter would, and ``counts`` is returned as it is.
    """
    if not calls:
        return counts
    source = next((each for each in (counts, *others) if each.samples.get(CALLS)), None)
    if source is None:
        return counts
    common = _common_labels(next(iter(source.samples[CALLS])))
    # A new exposition sharing ``counts``'s other families: only the calls' is written.
    families = dict(counts.families)
    families.setdefault(CALLS, source.families[CALLS])
    into = dict(counts.samples.get(CALLS, {}))
    kept = Exposition(families, {**counts.samples, CALLS: into})
    for tallied in calls:
        for key, value in _series(common, tallied):
            into[key] = max(into.get(key, 0.0), value)
    return kept


def _common_labels(key: str) -> dict[str, str]:
    """The labels of the sample ``key`` that every series of the family has, as written."""
    labels = key.partition("{")[2]
    return {name: value for name, value in _LABEL.findall(labels) if name not in _OWN_LABELS}


def _series(common: dict[str, str], tallied: TalliedCalls) -> Iterator[tuple[str, float]]:
    labels = {**common, "rpc_method": escaped(tallied.method)}
    if tallied.error_type:
        labels["error_type"] = escaped(tallied.error_type)
    bounds = (*SECONDS_BUCKETS, math.inf)
    for bound, calls in zip(bounds, itertools.accumulate(tallied.buckets), strict=True):
        yield _key(f"{CALLS}_bucket", {**labels, "le": go_float(bound)}), float(calls)
    yield _key(f"{CALLS}_count", labels), float(tallied.count)
    yield _key(f"{CALLS}_sum", labels), tallied.seconds


def _key(name: str, labels: dict[str, str]) -> str:
    written = ",".join(f'{label}="{value}"' for label, value in sorted(labels.items()) if value)
    return f"{name}{{{written}}}" if written else name
