"""The bench's asyncio peer (bench.baselines.asyncio_peer) does the work Fanout does.

Its CPU per call is compared with Fanout's in ``make bench``, so it must answer the same
panels as the hand-written gevent baseline from the same backends, give a lookup that
outlives the deadline a TIMEOUT outcome and still serve the next call, and refuse a bad
request with the declared ``InvalidRequest``.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness.calls import sample_call
from bench.harness.stack import StackSpec, start_stack
from service.client import AppStatsClient
from service.idl import appstats

DELAY_MS = 150  # each backend operation's added delay


def _answers(server: str) -> tuple[dict[str, Any], list[Any], dict[str, Any], int]:
    """The panels of a whole call, the outcomes of a call whose deadline ends before any
    backend answers, the server's ready facts, and the MongoDB commands a later whole call
    sent (as the responder counted them)."""
    spec = StackSpec(server=server, delay_ms=DELAY_MS, max_connections=100)
    with start_stack(spec, timeout_s=60) as stack:
        host, port = stack.address
        with AppStatsClient(host, port, timeout_ms=5000) as client:
            cut = client.get_app_stats(*sample_call(), deadline_ms=DELAY_MS // 3)
            whole = client.get_app_stats(*sample_call(), deadline_ms=5000)
            with pytest.raises(appstats.InvalidRequest) as refused:
                client.get_app_stats("shop", 10, 5, deadline_ms=5000)
            assert "start_ms" in refused.value.field or "end_ms" in refused.value.field
            # The cut call's commands were answered before the whole call's: none in flight.
            before = stack.mongo_aggregations()
            client.get_app_stats(*sample_call(), deadline_ms=5000)
            after = stack.mongo_aggregations()
        facts = stack.processes["server"].facts
    assert [o.status for o in whole.outcomes] == [appstats.TaskStatus.OK] * 7
    assert before is not None and after is not None
    return whole.panels, cut.outcomes, facts, after - before


def test_the_asyncio_peer_answers_as_the_hand_written_server_does() -> None:
    panels, cut, facts, commands = _answers("asyncio")
    theirs, _, _, their_commands = _answers("handwritten")
    assert panels == theirs
    # One aggregation a MongoDB panel (errors, urls, controllers, queries): what `make bench`
    # reports per call, counted by the responder.
    assert commands == their_commands == 4
    assert [o.status for o in cut] == [appstats.TaskStatus.TIMEOUT] * 7
    assert all(o.retryable for o in cut)
    assert facts["server"] == "asyncio"
