"""Write the Grafana dashboard (``fanout.json``) from the panels listed here: one place for
its queries, which a test runs against a real Prometheus scraping a real group of workers.

Usage: ``python deploy/grafana/dashboard.py [OUT]`` (``make monitoring`` runs it). Import
``fanout.json`` in Grafana (Dashboards, New, Import) and pick the Prometheus data source.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "fanout.json"
#: Every query is per scrape target: ``$instance`` is a Grafana variable (all by default).
SEL = 'job="fanout",instance=~"$instance"'
CALLS = f'{SEL},rpc_method="AppStats/get_app_stats"'

#: Rows of panels: (row title, [(panel title, unit, [(PromQL, legend)])]).
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Calls",
        [
            (
                "Calls answered, by outcome",
                "reqps",
                [
                    (
                        f"sum by (error_type) (rate(rpc_server_call_duration_seconds_count"
                        f"{{{CALLS}}}[$__rate_interval]))",
                        "{{error_type}}",
                    )
                ],
            ),
            (
                "Call latency (refusals left out)",
                "s",
                [
                    (
                        f"histogram_quantile({q}, sum by (le) (rate("
                        f'rpc_server_call_duration_seconds_bucket{{{CALLS},error_type!="Overloaded"}}'
                        f"[$__rate_interval])))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.9, 0.99)
                ],
            ),
            (
                "SLO: error budget left over 30 days",
                "percentunit",
                [
                    (
                        'slo:period_error_budget_remaining:ratio{sloth_service="fanout"}',
                        "{{sloth_slo}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Panels",
        [
            (
                "Panel outcomes not OK",
                "ops",
                [
                    (
                        f"sum by (fanout_task_name, fanout_task_status) (rate("
                        f'fanout_task_duration_seconds_count{{{SEL},fanout_task_status!="OK"}}'
                        f"[$__rate_interval]))",
                        "{{fanout_task_name}} {{fanout_task_status}}",
                    )
                ],
            ),
            (
                "Panel p99 duration",
                "s",
                [
                    (
                        f"histogram_quantile(0.99, sum by (le, fanout_task_name) (rate("
                        f"fanout_task_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
                        "{{fanout_task_name}}",
                    )
                ],
            ),
            (
                "Panels skipped (shed or disabled)",
                "ops",
                [
                    (
                        f"sum by (fanout_skip_reason) (rate(fanout_panels_skipped_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "{{fanout_skip_reason}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Overload",
        [
            (
                "Admission: limit, in flight, queued",
                "short",
                [
                    (f"sum(fanout_admission_limit{{{SEL}}})", "limit"),
                    (f"sum(fanout_admission_limit_min{{{SEL}}})", "floor"),
                    (f"sum(fanout_admission_inflight{{{SEL}}})", "in flight"),
                    (f"sum(fanout_admission_queued{{{SEL}}})", "queued"),
                ],
            ),
            (
                "Refusals by criticality",
                "reqps",
                [
                    (
                        f"sum by (fanout_criticality) (rate(fanout_calls_refused_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "{{fanout_criticality}}",
                    ),
                    (
                        f"sum(rate(fanout_calls_overloaded_total{{{SEL}}}[$__rate_interval]))",
                        "all Overloaded",
                    ),
                ],
            ),
            (
                "Brownout dimmer",
                "percentunit",
                [(f"max by (instance) (fanout_brownout_level{{{SEL}}})", "{{instance}}")],
            ),
        ],
    ),
    (
        "Pools",
        [
            (
                "Slots in use (p99) against size",
                "percentunit",
                [
                    (
                        f"max by (fanout_pool_name) (fanout_pool_in_use_p99{{{SEL}}}"
                        f" / fanout_pool_size{{{SEL}}})",
                        "{{fanout_pool_name}}",
                    )
                ],
            ),
            (
                "Wait for a slot, p99",
                "s",
                [
                    (
                        f"max by (fanout_pool_name) (fanout_pool_wait_p99_seconds{{{SEL}}})",
                        "{{fanout_pool_name}}",
                    )
                ],
            ),
            (
                "Advice against size",
                "short",
                [
                    (
                        f"max by (fanout_pool_name) (fanout_pool_recommended{{{SEL}}})",
                        "{{fanout_pool_name}} advised",
                    ),
                    (
                        f"max by (fanout_pool_name) (fanout_pool_size{{{SEL}}})",
                        "{{fanout_pool_name}} size",
                    ),
                ],
            ),
        ],
    ),
    (
        "Backends and the results cache",
        [
            (
                "Backends: up (1) and circuit (0 closed, 1 half open, 2 open)",
                "short",
                [
                    (
                        f"min by (fanout_backend) (fanout_backend_up{{{SEL}}})",
                        "{{fanout_backend}} up",
                    ),
                    (
                        f"max by (fanout_backend) (fanout_circuit_state{{{SEL}}})",
                        "{{fanout_backend}} circuit",
                    ),
                ],
            ),
            (
                "Backend calls failed after their retries",
                "percentunit",
                [
                    (
                        f"sum by (fanout_backend) (rate(fanout_backend_failures_total{{{SEL}}}"
                        f"[$__rate_interval])) / sum by (fanout_backend) (rate("
                        f"fanout_backend_calls_total{{{SEL}}}[$__rate_interval]))",
                        "{{fanout_backend}}",
                    )
                ],
            ),
            (
                "Results cache: buckets read and missed; its store up (1)",
                "ops",
                [
                    (f"sum(rate(fanout_cache_hits_total{{{SEL}}}[$__rate_interval]))", "hits"),
                    (
                        f"sum(rate(fanout_cache_misses_total{{{SEL}}}[$__rate_interval]))",
                        "misses",
                    ),
                    (
                        f"min by (instance) (fanout_cache_store_up{{{SEL}}})",
                        "{{instance}} store up",
                    ),
                ],
            ),
        ],
    ),
    (
        "Workers and TLS",
        [
            (
                "Workers: configured, answering the master, and exits",
                "short",
                [
                    (
                        f"sum by (instance) (fanout_workers_configured{{{SEL}}})",
                        "{{instance}} configured",
                    ),
                    (
                        f"sum by (instance) (fanout_worker_scraped{{{SEL}}})",
                        "{{instance}} answering",
                    ),
                    (
                        f"sum by (instance) (increase(fanout_worker_exits_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "{{instance}} exits",
                    ),
                    (
                        f"sum by (instance, worker) (fanout_worker_connections{{{SEL}}})",
                        "{{instance}} worker {{worker}} connections",
                    ),
                    ('sum(up{job="fanout",instance=~"$instance"})', "targets scraped"),
                ],
            ),
            (
                "Per second: event loop blocked, TLS handshakes refused",
                "short",
                [
                    (
                        f"sum by (instance) (rate(fanout_event_loop_blocked_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "{{instance}} loop blocked",
                    ),
                    (
                        f"sum by (fanout_tls_reason) (rate(fanout_tls_handshakes_refused_total"
                        f"{{{SEL}}}[$__rate_interval]))",
                        "TLS refused: {{fanout_tls_reason}}",
                    ),
                ],
            ),
            (
                "Traces a second: kept by why, dropped (tail capture)",
                "short",
                [
                    (
                        f"sum by (reason) (rate(fanout_traces_kept_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "kept: {{reason}}",
                    ),
                    (
                        f"sum by (reason) (rate(fanout_traces_dropped_total{{{SEL}}}"
                        f"[$__rate_interval]))",
                        "dropped: {{reason}}",
                    ),
                ],
            ),
            (
                "TLS certificates in use: time left",
                "s",
                [
                    (
                        f"min by (fanout_tls_certificate) ("
                        f"fanout_tls_certificate_expiration_timestamp_seconds{{{SEL}}}) - time()",
                        "{{fanout_tls_certificate}}",
                    )
                ],
            ),
        ],
    ),
]


def queries() -> list[str]:
    """Every panel's queries, in order."""
    return [expr for _, panels in ROWS for _, _, targets in panels for expr, _ in targets]


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model: a row of three panels per entry of :data:`ROWS`."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row_title, row in ROWS:
        panels.append(_row(len(panels) + 1, row_title, y))
        y += 1
        for column, (title, unit, targets) in enumerate(row):
            panels.append(_panel(len(panels) + 1, title, unit, targets, 8 * column, y))
        y += 8
    return {
        "uid": "fanout",
        "title": "Fanout",
        "tags": ["fanout"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [_datasource_variable(), _instance_variable()]},
        "panels": panels,
    }


def _row(id_: int, title: str, y: int) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
    }


def _panel(
    id_: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int
) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
        "label": "Data source",
    }


def _instance_variable() -> dict[str, Any]:
    return {
        "name": "instance",
        "type": "query",
        "label": "Instance",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": 'label_values(up{job="fanout"}, instance)',
        "includeAll": True,
        "multi": True,
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=OUT, help=f"default: {OUT.name}")
    out = parser.parse_args(argv).out
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
