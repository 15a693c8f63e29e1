"""Callers end to end, on a real ``fanout serve``: each names itself (``RequestMeta.caller``)
or is the anonymous caller; the scrape and ``fanout pools`` count each one's calls exactly
as the callers received them; a bad name is a typed error naming the field.

The order fair share serves callers in is ``test_fair_share.py``'s; a client certificate
naming the caller is ``test_mutual_tls.py``'s; the shares under load are ``make bench``'s.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from typing import Any

import pytest
import requests

from service.client import AppStatsClient
from service.idl import appstats
from service.samples import SAMPLE_END_MS, SAMPLE_START_MS
from tests.support.processes import FANOUT
from tests.support.sockets import wait_for

# The dimmer held at 0.5 refuses every SHEDDABLE call and no other: refusals on demand,
# without load, whatever the machine's pace.
CALLS = [("pages", None), ("reports", "SHEDDABLE"), (None, None), (None, "SHEDDABLE")] * 3


def test_each_callers_calls_are_counted_as_they_received_them(
    serve: Any, http_services: Any
) -> None:
    server = serve(
        http_services,
        **{
            "metrics.exporter": "prometheus",
            "metrics.port": 0,
            "admission.brownout_min_level": 0.5,
            "callers.reports.weight": 3,
        },
    )
    received: Counter[tuple[str, str]] = Counter()
    for caller, criticality in CALLS:
        with AppStatsClient(
            "127.0.0.1", server.port, overload_retry_ratio=0.0, caller=caller
        ) as client:
            try:
                client.get_app_stats(
                    "shop", SAMPLE_START_MS, SAMPLE_END_MS, criticality=criticality
                )
                received[caller or "anonymous", "admitted"] += 1
            except appstats.Overloaded:
                received[caller or "anonymous", "refused"] += 1
    assert received == {
        ("pages", "admitted"): 3,
        ("reports", "refused"): 3,
        ("anonymous", "admitted"): 3,
        ("anonymous", "refused"): 3,
    }
    found = wait_for(
        lambda: re.search(r"Prometheus scrape at (http://\S+/metrics)", server.log()),
        10,
        "the scrape address in the log",
    )
    text = requests.get(found.group(1), timeout=5).text
    for caller in ("pages", "reports", "anonymous"):
        for kind in ("admitted", "refused"):
            assert re.search(
                rf'^fanout_callers_{kind}_total\{{.*fanout_caller="{caller}".*\}} '
                rf"{received[caller, kind]}\.0$",
                text,
                re.M,
            ), text
    pools = subprocess.run(
        [*FANOUT, "pools", "--port", str(server.port)], capture_output=True, text=True, timeout=60
    )
    assert pools.returncode == 0, pools.stderr
    # The configured weight, and the counts; the share is 0 once the caller is not active.
    assert re.search(
        r"^caller reports weight=3 share=\d+\.\d in_flight=0 admitted=0 refused=3$",
        pools.stdout,
        re.M,
    ), pools.stdout
    assert re.search(r"^caller pages weight=1 .* admitted=3 refused=0$", pools.stdout, re.M)


def test_a_bad_caller_name_is_refused_naming_the_field(serve: Any, http_services: Any) -> None:
    server = serve(http_services)
    for name in ["has space", "", "-leading", "x" * 129, "é"]:
        with AppStatsClient("127.0.0.1", server.port, caller=name) as client:
            with pytest.raises(appstats.InvalidRequest) as invalid:
                client.get_app_stats("shop", SAMPLE_START_MS, SAMPLE_END_MS)
        assert invalid.value.field == "meta.caller", name
