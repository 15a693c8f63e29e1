"""The path of one call, written down in docs/architecture.md, is the path the code runs."""

from __future__ import annotations

import re
from pathlib import Path

from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.call_path import files_of_one_warm_call
from tests.support.thrift_calls import encode_call, frame

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def documented_path() -> list[str]:
    """The files listed, in order, under "The path of one warm call"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## The path of one warm call", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, re.M)


def test_the_documented_path_of_one_warm_call_is_the_one_it_runs(start_service) -> None:
    service, _ = start_service()
    call = frame(encode_call("get_app_stats", appstats.AppStats.get_app_stats_args(
        request=appstats.StatsRequest(app="shop", start_ms=SAMPLE_START_MS, end_ms=SAMPLE_END_MS))))
    ran = files_of_one_warm_call(service.address, call)
    documented = documented_path()
    assert len(documented) == len(set(documented)), "a file listed twice"
    assert sorted(ran - set(documented)) == [], "run, but not in docs/architecture.md's path"
    assert sorted(set(documented) - ran) == [], "in docs/architecture.md's path, but not run"
