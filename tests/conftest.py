"""Test bootstrap: gevent must patch the standard library before pymongo or requests load.

`make test` runs pytest under ``python -m gevent.monkey``; this call is a no-op
then, and keeps a plain ``pytest`` run correct too.
"""

from gevent import monkey

monkey.patch_all()

pytest_plugins: list[str] = ["tests.support.tracing", "tests.support.server", "tests.support.samples",
                             "tests.support.processes"]
