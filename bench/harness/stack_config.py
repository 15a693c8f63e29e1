"""The TOML file every server of a benchmark stack reads (``fanout serve --config`` and
the baselines), made from its :class:`~bench.harness.stack.StackSpec`."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["stack_config", "SAMPLE_RATIOS", "OFFICIAL_MONGO", "HEAD_ONLY"]

#: The traced modes of a stack (``StackSpec.tracing``) and the share of calls each samples;
#: a mode ending in :data:`OFFICIAL_MONGO` has the pymongo instrumentation make the
#: MongoDB spans (``tracing.mongo_spans = "official"``) instead of Fanout; one ending in
#: :data:`HEAD_ONLY` samples at the head alone (``tracing.tail_capture = false``).
SAMPLE_RATIOS = {
    "ratio1": 0.01,
    "ratio10": 0.1,
    "full": 1.0,
    "ratio1-official-mongo": 0.01,
    "ratio1-head": 0.01,
    "full-head": 1.0,
}
OFFICIAL_MONGO = "-official-mongo"
HEAD_ONLY = "-head"


def stack_config(
    spec: Any, mongo_uri: str, alerts_url: str, metrics_url: str, otlp_endpoint: str | None
) -> str:
    """The TOML every server of the stack reads (``fanout serve --config`` and the baselines)."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
        f"max_connections = {spec.max_connections}",
        f"workers = {spec.workers}",
        # The hub monitor at its default (as shipped) only where a scenario asks for it.
        *([] if spec.hub_monitor else ["hub_block_threshold_ms = 0"]),
        "drain_timeout_ms = 2000",
        "idle_timeout_ms = 600000",
        "",
        "[fanout]",
        "pool_size = 16",
        "max_inflight_tasks = 20000",
        "request_deadline_ms = 2000",
        f"coalesce = {str(spec.coalesce).lower()}",
        f"merge_commands = {str(spec.merge_commands).lower()}",
        "",
        "[mongo]",
        f"uri = {q(mongo_uri)}",
        'database = "apm"',
        f"max_pool_size = {spec.pool_size}",
        "",
        "[http]",
        f"alerts_url = {q(alerts_url)}",
        f"metrics_url = {q(metrics_url)}",
        f"pool_maxsize = {spec.pool_size}",
        "",
    ]
    lines += [
        "[admission]",
        f"brownout = {str(spec.brownout).lower()}",
        f"fair_share = {str(spec.fair_share).lower()}",
    ]
    if spec.admission != "adaptive":
        # Nearly every call refused: what one refusal costs, read in full and answered at
        # once ("one"), or as callers ignoring retry_after_ms get it ("one-held").
        lines += [
            "initial_limit = 1",
            "min_limit = 1",
            "max_limit = 1",
            f"hold_refusals = {'true' if spec.admission == 'one-held' else 'false'}",
        ]
    lines.append("")
    for name, weight in spec.callers:
        lines += [f"[callers.{q(name)}]", f"weight = {weight}", ""]
    lines.append("[tracing]")
    if spec.tracing == "off":
        lines.append("enabled = false")
    else:
        ratio = SAMPLE_RATIOS[spec.tracing]
        lines += [
            "enabled = true",
            'exporter = "otlp"',
            'otlp_protocol = "http/protobuf"',
            f"endpoint = {q(otlp_endpoint or '')}",
            f"sample_ratio = {ratio}",
            'service_name = "fanout-bench"',
            "flush_timeout_ms = 2000",
        ]
        if spec.tracing.endswith(OFFICIAL_MONGO):
            lines.append('mongo_spans = "official"')
        if spec.tracing.endswith(HEAD_ONLY):
            lines.append("tail_capture = false")
        if spec.tail_max_per_s:
            lines.append(f"tail_max_per_s = {spec.tail_max_per_s}")
    return "\n".join(lines) + "\n"
