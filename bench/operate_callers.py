"""Callers for ``bench.operate``'s reload phase: ``AppStatsClient`` as the web tier uses it.

    python -m gevent.monkey --module bench.operate_callers PORT CALLERS SECONDS

Prints one JSON line: calls answered in full, and every failure by kind.
"""

from __future__ import annotations

import json
import sys
import time

import gevent

from service.client import AppStatsClient
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS


def main() -> int:
    port, callers, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    counts: dict[str, int] = {"ok": 0}
    ends = time.monotonic() + seconds

    def call(client: AppStatsClient) -> None:
        while time.monotonic() < ends:
            try:
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS, deadline_ms=1000)
                counts["ok"] += 1
            except Exception as exc:
                counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1

    with AppStatsClient("127.0.0.1", port, pool_size=callers, timeout_ms=2000) as client:
        gevent.joinall([gevent.spawn(call, client) for _ in range(callers)], timeout=seconds + 10)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
