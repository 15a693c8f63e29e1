"""``make test``'s runner (tests/parallel.py): how it splits the suite into processes."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tests import parallel  # the module: its test_targets() is no test
from tests.parallel import SOLO, compile_sources, deal, phase_arguments


def test_each_phase_gets_its_marker_joined_with_the_callers() -> None:
    assert phase_arguments(["-x"], "rest") == ["-x", "-m", f"not {SOLO}"]
    assert phase_arguments([], SOLO) == ["-m", SOLO]
    assert phase_arguments(["-k", "tls", "-m", "a or b", "-q"], "rest") == [
        "-k",
        "tls",
        "-q",
        "-m",
        f"(a or b) and not {SOLO}",
    ]
    assert phase_arguments(["-mslow"], SOLO) == ["-m", f"(slow) and {SOLO}"]


def test_every_target_is_dealt_once_and_the_heaviest_go_to_different_groups() -> None:
    targets = parallel.test_targets()
    groups = deal(targets, 5)
    dealt = [target for group in groups for target in group]
    assert sorted(dealt) == sorted(targets) and len(groups) == 5
    firsts = {"tests/test_image.py", "tests/test_worker_group.py"}
    assert all(len(firsts & set(group)) <= 1 for group in groups)


def test_the_helpers_in_tests_support_have_their_asserts_rewritten() -> None:
    """A failing assert in a helper shows the values it compared (tests/conftest.py)."""
    from _pytest.assertion.rewrite import AssertionRewritingHook

    import tests.support.thrift_calls as helper

    assert isinstance(helper.__loader__, AssertionRewritingHook)


def test_a_solo_test_outside_the_solo_phases_files_is_found() -> None:
    tests = [
        ("tests/test_a.py::test_one", True),
        ("tests/test_a.py::test_two", False),
        ("tests/interop/test_c.py::test_three[x]", True),
        ("tests/test_b.py::test_four", True),
        ("tests/test_d.py::test_five", False),
    ]
    assert parallel.solo_tests_outside(tests, ["tests/test_a.py", "tests/interop"]) == [
        "tests/test_b.py::test_four"
    ]
    assert parallel.solo_tests_outside(tests, ["tests/test_a.py", "tests/test_b.py"]) == [
        "tests/interop/test_c.py::test_three[x]"
    ]


def test_a_group_process_stops_when_the_solo_phase_would_miss_a_solo_test() -> None:
    """tests/conftest.py checks what it collects against the files the runner names (every
    group process of ``make test`` passes the check)."""
    import os
    import subprocess
    import sys

    target = "tests/test_pacing.py"  # marks one test solo
    assert target in parallel.solo_targets([target])
    refused = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", target],
        cwd=parallel.ROOT,
        env={**os.environ, parallel.SOLO_FILES_ENV: "tests/test_cli.py"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 4 and f"{target}::" in refused.stderr, refused.stderr


def test_the_sources_are_compiled_once_whatever_the_environment_says(tmp_path: Path) -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (as this machine may set it) the runner still
    writes the bytecode every process of the suite then reads instead of compiling."""
    package = tmp_path / "service"
    package.mkdir()
    module = package / "thing.py"
    module.write_text("VALUE = 1\n")
    cached = Path(importlib.util.cache_from_source(str(module)))
    assert compile_sources(tmp_path) and cached.exists()
    written = cached.stat().st_mtime_ns
    os.utime(cached, ns=(written - 10**9, written - 10**9))  # what is up to date stays
    assert compile_sources(tmp_path) and cached.stat().st_mtime_ns == written - 10**9
    (package / "broken.py").write_text("def (:\n")
    assert not compile_sources(tmp_path)
