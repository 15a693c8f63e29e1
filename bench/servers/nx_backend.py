"""nx-27017 as a benchmark backend: the real MongoDB-wire server of the tests, seeded, no delay.

Used by the one scenario that runs real queries (``StackSpec(mongo="nx")``). Starts
:class:`service.samples.MongoWireServer` (an ``nx-27017`` child process), seeds it
with the sample data in database ``apm``, prints ``READY {"uri": ..., "pid": ...}``
(``pid`` is the nx-27017 process, whose CPU the benchmark reports), and stops it on
SIGTERM or SIGINT::

    python -m bench.servers.nx_backend
"""

from __future__ import annotations

import argparse
import logging

from bench.servers.ready import announce_ready, wait_for_stop_signal
from service.samples import DEFAULT_SEED, MongoWireServer, generate_sample_data, seed_mongo_at

__all__ = ["DATABASE", "main"]

DATABASE = "apm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.servers.nx_backend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING")
    with MongoWireServer() as server:
        seed_mongo_at(server.uri, DATABASE, generate_sample_data(args.seed))
        pid_file = server.workdir / "server.pid" if server.workdir is not None else None
        pid = (
            int(pid_file.read_text().strip())
            if pid_file is not None and pid_file.exists()
            else None
        )
        announce_ready(uri=server.uri, port=server.port, pid=pid)
        wait_for_stop_signal()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
