"""``make test``'s runner (tests/parallel.py): how it splits the suite into processes."""

from __future__ import annotations

from tests import parallel  # the module: its test_targets() is no test
from tests.parallel import SOLO, deal, phase_arguments


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


def test_the_solo_phase_collects_every_file_with_a_solo_test() -> None:
    """The solo phase reads only the files marking a test solo; pytest, collecting every
    file, finds solo tests in those files and no others."""
    import subprocess
    import sys

    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [*pytest, "--collect-only", "-q", "-m", SOLO, "tests"],
        cwd=parallel.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    chosen = parallel.solo_targets(parallel.test_targets())
    assert files and {f.split("/")[1] for f in files} == {t.split("/")[1] for t in chosen}
