"""A worker's Prometheus text exposition, read and written line by line for the master.

The master reads every worker's scrape at each of its own (``service.workers.group``)
and writes them out again as one, each sample labelled with its worker. prometheus_client's
parser builds a ``Metric`` and a ``Sample`` per line and parses every label, and
``generate_latest`` escapes every label again: together they were most of what a merged
scrape cost the master (``make bench-group``'s ``rest`` phase measures it:
``docs/performance/group.json``), for samples it only adds up
and passes on. The workers' text comes from one producer (the OpenTelemetry Prometheus
exporter, through prometheus_client's ``generate_latest``), so a sample's name and
labels are the same string in every worker's scrape and in every scrape of one worker:
that string is its key, kept as it came, and only the value after it is parsed.

What is read: ``# HELP`` and ``# TYPE`` lines, kept for the family they name, and
``name{labels} value`` lines (no timestamp: the exporter writes none), each belonging
to the family of the ``# TYPE`` before it (a sample before any is dropped).
``_created`` samples (a lifetime's start) are dropped: they are not summed. The
workers' samples carry no ``worker`` label; the master adds it.

One thing in a key is rewritten: a label with an empty value is left out. To Prometheus
it is the same series either way, but the exporter writes it only when another series of
the family has the label (``error_type=""`` beside an ``error_type="Overloaded"``), so a
worker that has refused a call and its predecessor that had not would otherwise give one
series under two keys, written twice in the merged scrape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = [
    "Exposition",
    "Family",
    "parse_exposition",
    "render_expositions",
    "without_empty_labels",
    "escaped",
    "go_float",
]

#: The family types whose samples only ever grow, and so are summed across lifetimes.
CUMULATIVE = frozenset({"counter", "histogram"})
# A label whose value is empty, after the brace or the comma that opens it (a value's own
# quotes are escaped, so ="" can only end a label).
_EMPTY_LABEL = re.compile(r'(?<=[{,])\w+="",?')


@dataclass
class Family:
    """A family's header lines as they came, and its type."""

    header: str
    type: str


@dataclass
class Exposition:
    """One exposition: each family's header and, by sample (name and labels as written),
    its value."""

    families: dict[str, Family] = field(default_factory=dict)
    samples: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, other: Exposition, cumulative: bool) -> None:
        """Add ``other``'s cumulative families (counters, histograms), or its others."""
        for name, family in other.families.items():
            if (family.type in CUMULATIVE) != cumulative:
                continue
            self.families.setdefault(name, family)
            into = self.samples.setdefault(name, {})
            for key, value in other.samples[name].items():
                into[key] = into.get(key, 0.0) + value


def parse_exposition(text: str) -> Exposition:
    """``text``, a worker's scrape, as families and samples; raises :class:`ValueError` for
    a sample line whose value is not a number."""
    parsed = Exposition()
    helps: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] == "HELP":
                helps[parts[2]] = line
            elif len(parts) == 4 and parts[1] == "TYPE":
                name = parts[2]
                header = f"{helps[name]}\n{line}" if name in helps else line
                parsed.families[name] = Family(header, parts[3])
                samples = parsed.samples[name] = {}
            continue
        key, _, value = line.rpartition(" ")
        if not key:
            raise ValueError(f"not a sample line: {line[:80]!r}")
        if key.partition("{")[0].endswith("_created"):
            continue
        if '=""' in key:
            key = without_empty_labels(key)
        samples[key] = float(value)
    return parsed


def without_empty_labels(key: str) -> str:
    """The sample ``key`` (``name{labels}``) without the labels whose value is empty."""
    key = _EMPTY_LABEL.sub("", key)
    if key.endswith(",}"):
        key = key[:-2] + "}"
    return key[:-2] if key.endswith("{}") else key


def render_expositions(expositions: dict[str, Exposition], label: str) -> str:
    """One exposition of ``expositions`` (by position), each sample labelled ``label``
    with its position; families in the order first seen."""
    families: dict[str, Family] = {}
    for exposition in expositions.values():
        for name, family in exposition.families.items():
            families.setdefault(name, family)
    lines = []
    for name, family in families.items():
        lines.append(family.header)
        for position, exposition in expositions.items():
            tag = f'{label}="{escaped(position)}"'
            for key, value in exposition.samples.get(name, {}).items():
                labelled = _labelled(key, tag)
                lines.append(f"{labelled} {go_float(value)}")
    lines.append("")
    return "\n".join(lines)


def _labelled(key: str, tag: str) -> str:
    """The sample ``key`` (``name`` or ``name{labels}``) with the label ``tag`` added."""
    if key[-1] != "}":
        return f"{key}{{{tag}}}"
    labels = key[:-1]
    return f"{labels}{tag}}}" if labels[-1] == "{" else f"{labels},{tag}}}"


def escaped(value: str) -> str:
    """``value`` as a label value is written between its quotes."""
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def go_float(value: float) -> str:
    """``value`` as the text format writes it (``+Inf``, ``-Inf``, ``NaN``)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(value)
