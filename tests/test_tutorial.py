"""The tutorial (docs/tutorial/index.md): every command on the page runs, in order, and does
what the page says it does (tests/support/tutorial.py reads and runs the page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.toolchains import needs
from tests.support.tutorial import Tutorial, steps

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial" / "index.md"
PANELS = ("errors", "urls", "controllers", "queries", "alerts", "latency", "volume")

pytestmark = [pytest.mark.solo, pytest.mark.timeout(900)]


def _ports(page: str) -> set[str]:
    """The ports the page names: after ``port``, ``-port``, ``PORT=`` or a host's colon."""
    return set(re.findall(r"(?:port\s*=?\s*|port=|:)(\d{4,5})\b", page, re.I))


def test_the_page_has_every_kind_of_step() -> None:
    found = list(steps(PAGE.read_text()))
    assert {step.kind for step in found} == {"file", "server", "commands"}
    assert [s.name for s in found if s.kind == "file"] == ["fanout.toml", "fanout-ferretdb.toml"]
    assert any("make ferretdb" in s.text for s in found if s.kind == "server")
    assert {"9090", "9091", "27017", "27018", "8080", "9464"} <= _ports(PAGE.read_text())


@needs("compat")
def test_every_command_of_the_tutorial_runs(tmp_path: Path) -> None:
    page = PAGE.read_text()
    tutorial = Tutorial(ROOT, tmp_path)
    try:
        for step in steps(page):
            step = type(step)(
                step.kind, tutorial.with_free_ports(step.text, _ports(page)), step.name
            )
            tutorial.run(step, timeout_s=600 if "make" in step.text else 120)
    finally:
        tutorial.close()
    outputs = dict(tutorial.outputs)
    demo = outputs["make demo"]
    calls = [
        out
        for line, out in tutorial.outputs
        if "--start-ms 1767225600000" in line and "--panels" not in line
    ]
    assert len(calls) == 2, "one whole call on the sample backends, one on FerretDB"
    for answer in [demo, *calls]:
        for panel in PANELS:
            assert re.search(rf"^\s*{panel}\s+\w+\s+OK\b", answer, re.M), (panel, answer)
    two = next(out for line, out in tutorial.outputs if "--panels alerts,errors" in line)
    asked = re.findall(r"^\s*(\w+)\s+(?:mongo|http)\s+OK\b", two, re.M)
    assert asked == ["alerts", "errors"], two
    ready = next(out for line, out in tutorial.outputs if "/readyz" in line)
    assert "mongo" in ready, ready
    pools = next(out for line, out in tutorial.outputs if "fanout pools" in line)
    assert re.search(r"^worker=1\b", pools, re.M), pools
    scraped = next(out for line, out in tutorial.outputs if line.startswith("grep "))
    assert re.search(r'fanout_worker_scraped\{worker="1"[^}]*\} 1', scraped), scraped
