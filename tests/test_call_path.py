"""The path of one call, written down in docs/explanation/architecture.md, is the path the code runs."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.call_path import files_of_one_warm_call
from tests.support.samples import backend_overrides

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "explanation" / "architecture.md"


def documented_path() -> list[str]:
    """The files listed, in order, under "The path of one warm call"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The path of one warm call", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.M)


def test_the_documented_path_of_one_warm_call_is_the_one_it_runs(
    mongo_server, http_services
) -> None:
    ran = files_of_one_warm_call(backend_overrides(mongo_server, http_services))
    documented = documented_path()
    assert len(documented) == len(set(documented)), "a file listed twice"
    assert sorted(ran - set(documented)) == [], (
        "run, but not in docs/explanation/architecture.md's path"
    )
    assert sorted(set(documented) - ran) == [], (
        "in docs/explanation/architecture.md's path, but not run"
    )
