"""Test bootstrap: gevent must patch the standard library before pymongo or requests load.

`make test` runs pytest under ``python -m gevent.monkey``; this call is a no-op
then, and keeps a plain ``pytest`` run correct too.
"""

from gevent import monkey

monkey.patch_all()

import pytest  # noqa: E402

# Before any helper loads: an assert in tests/support/ then says what it saw, as in a test.
pytest.register_assert_rewrite("tests.support")

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
