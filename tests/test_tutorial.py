"""The tutorial (docs/tutorial/index.md): every command on the page runs, in order, and does
what the page says it does (tests/support/tutorial.py reads and runs the page).

The steps up to two workers as one service need nothing but the checkout; the optional
FerretDB step needs the ``compat`` toolchain, and its test runs the sample backends it
shares with the steps before it, then that step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support.toolchains import needs
from tests.support.tutorial import Step, Tutorial, steps

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial" / "index.md"
PANELS = ("errors", "urls", "controllers", "queries", "alerts", "latency", "volume")
OPTIONAL = "Optional:"  # a heading's mark: the steps under it are the optional ones

pytestmark = pytest.mark.timeout(900)


def _ports(page: str) -> set[str]:
    """The ports the page names: after ``port``, ``-port``, ``PORT=`` or a host's colon."""
    return set(re.findall(r"(?:port\s*=?\s*|port=|:)(\d{4,5})\b", page, re.I))


def _run(chosen: Iterable[Step], tmp_path: Path) -> list[tuple[str, str]]:
    """Run ``chosen`` steps of the page in order; each command's line and output."""
    page = PAGE.read_text()
    tutorial = Tutorial(ROOT, tmp_path)
    try:
        for step in chosen:
            text = tutorial.with_free_ports(step.text, _ports(page))
            tutorial.run(
                Step(step.kind, text, step.name, step.section),
                timeout_s=600 if "make" in step.text else 120,
            )
    finally:
        tutorial.close()
    return tutorial.outputs


def _whole(answer: str) -> None:
    for panel in PANELS:
        assert re.search(rf"^\s*{panel}\s+\w+\s+OK\b", answer, re.M), (panel, answer)


def test_the_page_has_every_kind_of_step_and_root_only_in_its_optional_one() -> None:
    found = list(steps(PAGE.read_text()))
    assert {step.kind for step in found} == {"file", "server", "commands"}
    assert [s.name for s in found if s.kind == "file"] == [
        "fanout.toml",
        "fanout-group.toml",
        "fanout-ferretdb.toml",
    ]
    needing_root = [s for s in found if "make ferretdb" in s.text]
    assert needing_root and all(OPTIONAL in s.section for s in needing_root)
    assert OPTIONAL in found[-1].section and OPTIONAL not in found[0].section
    assert {"9090", "9091", "9092", "27017", "27018", "8080", "9464"} <= _ports(PAGE.read_text())


def test_every_command_up_to_two_workers_runs_as_the_page_says(tmp_path: Path) -> None:
    outputs = _run((s for s in steps(PAGE.read_text()) if OPTIONAL not in s.section), tmp_path)
    _whole(dict(outputs)["make demo"])
    calls = [
        out
        for line, out in outputs
        if "--start-ms 1767225600000" in line and "--panels" not in line
    ]
    assert len(calls) == 2, "one whole call on the single server, one on the group"
    for answer in calls:
        _whole(answer)
    two = next(out for line, out in outputs if "--panels alerts,errors" in line)
    asked = re.findall(r"^\s*(\w+)\s+(?:mongo|http)\s+OK\b", two, re.M)
    assert asked == ["alerts", "errors"], two
    ready = next(out for line, out in outputs if "/readyz" in line)
    assert "mongo" in ready, ready
    pools = next(out for line, out in outputs if "fanout pools" in line)
    assert re.search(r"^worker=1\b", pools, re.M), pools
    scraped = next(out for line, out in outputs if line.startswith("grep "))
    assert re.search(r'fanout_worker_scraped\{worker="1"[^}]*\} 1', scraped), scraped


@pytest.mark.solo  # builds FerretDB's engine the first time: a core of its own
@needs("compat")
def test_the_optional_ferretdb_step_runs_as_the_page_says(tmp_path: Path) -> None:
    page = list(steps(PAGE.read_text()))
    backends = next(s for s in page if "fanout backends" in s.text)
    outputs = _run([backends, *(s for s in page if OPTIONAL in s.section)], tmp_path)
    [answer] = [out for line, out in outputs if "--start-ms 1767225600000" in line]
    _whole(answer)
