"""Test bootstrap: gevent must patch the standard library before pymongo or requests load.

`make test` runs pytest under ``python -m gevent.monkey``; this call is a no-op
then, and keeps a plain ``pytest`` run correct too.
"""

from gevent import monkey

monkey.patch_all()

import pytest  # noqa: E402

# Before any helper loads: an assert in tests/support/ then says what it saw, as in a test.
pytest.register_assert_rewrite("tests.support")

import os  # noqa: E402

from tests.parallel import SOLO, SOLO_FILES_ENV, solo_tests_outside  # noqa: E402
from tests.support import toolchains  # noqa: E402

pytest_plugins: list[str] = [
    "tests.support.tracing",
    "tests.support.server",
    "tests.support.samples",
    "tests.support.processes",
    "tests.support.dist",
    "tests.support.redis_server",
    "tests.support.pacing",
]


def pytest_configure(config: pytest.Config) -> None:
    toolchains.check_required()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return toolchains.header_lines()


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects the solo tests of the group phase
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``make test``, a solo test outside the files the solo phase reads would run in
    neither phase: the run stops, naming it."""
    solo_files = os.environ.get(SOLO_FILES_ENV)
    if solo_files is None:
        return
    tested = [(item.nodeid, item.get_closest_marker(SOLO) is not None) for item in items]
    if missed := solo_tests_outside(tested, solo_files.split(",")):
        raise pytest.UsageError(
            f"tests marked {SOLO} in files that tests/parallel.py does not see as such "
            f"(it looks for 'mark.{SOLO}' in the file's text): {', '.join(missed)}"
        )
