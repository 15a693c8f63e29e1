"""Sequential baseline: the same seven lookups called one after another in the handler.

The "before" picture. Served by Fanout's own :class:`service.listener.server.ThriftServer` under
gevent (monkey-patched, as ``fanout serve`` is), with the same settings, lookups and
response mapping (:mod:`bench.baselines.common`), so only the fan-out differs: a call
takes the sum of its lookups' times instead of the longest.

    python -m bench.baselines.sequential --config bench.toml

prints ``READY {"host": ..., "port": ...}`` once listening; stops on SIGTERM or SIGINT.
"""

# gevent must patch the standard library before pymongo and requests load.
from gevent import monkey

monkey.patch_all()

from collections.abc import Sequence

from thriftpy2.thrift import TProcessor

from bench.baselines.common import (
    BaselineHandler,
    PlannedLookup,
    lookup_outcome,
    settings_from_argv,
)
from bench.servers.ready import announce_ready, wait_for_stop_signal
from lookups.backends.collection import Backends
from lookups.deadline import Deadline
from lookups.panels import Window
from lookups.registry import default_registry
from service.engine.tasks import TaskOutcome
from service.idl import appstats
from service.listener.server import ThriftServer

__all__ = ["SequentialHandler", "main"]


class SequentialHandler(BaselineHandler):
    """Runs the planned lookups in order, each within min(its timeout, time left)."""

    def gather(
        self, window: Window, planned: Sequence[PlannedLookup], deadline: Deadline
    ) -> list[TaskOutcome]:
        return [
            lookup_outcome(lookup, window, timeout_ms, deadline) for lookup, timeout_ms in planned
        ]


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from_argv("python -m bench.baselines.sequential", argv)
    with Backends(settings.backends) as backends:
        handler = SequentialHandler(settings, default_registry().build(backends))
        server = ThriftServer(TProcessor(appstats.AppStats, handler), settings.server)
        server.start()
        host, port = server.address
        announce_ready(host=host, port=port, server="sequential")
        wait_for_stop_signal()
        server.stop(settings.server.drain_timeout_ms / 1000.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
