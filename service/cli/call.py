"""``fanout call`` and ``fanout pools``: one call to a running server, printed.

Declared exceptions exit 1 with their message; a server that cannot be reached
exits 1 naming its address. ``get_app_stats`` without a window asks for the last
hour, and says where the sample backends' data is when no panel holds any.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from lookups.clock import SYSTEM_CLOCK
from service.settings.config import ConfigError, Settings

__all__ = ["run_call", "sample_window"]


class _CallFailed(Exception):
    """The server answered a call with a declared exception; ``str`` says which, and
    :meth:`to_json` says it for ``--json``."""

    def __init__(self, declared: Any) -> None:
        super().__init__(f"{type(declared).__name__}: {declared.message}")
        self.declared = declared

    def to_json(self) -> dict[str, Any]:
        """``{"error": "Overloaded", "message": ..., "retry_after_ms": 40}``: the exception's
        name and its declared fields that are set (a ``PanelFailed``'s outcomes as in an
        answer's JSON)."""
        from service.cli.report import outcomes_to_json

        fields = {
            name: value
            for name, value in vars(self.declared).items()
            if value is not None and not name.startswith("_") and name != "outcomes"
        }
        if getattr(self.declared, "outcomes", None) is not None:
            fields["outcomes"] = outcomes_to_json(self.declared.outcomes)
        return {"error": type(self.declared).__name__, **fields}


def run_call(
    args: argparse.Namespace, settings_of: Callable[[argparse.Namespace], Settings]
) -> int:
    """``fanout call`` and ``fanout pools``: call the server, print the answer; the exit code."""
    from thriftpy2.transport import TTransportException

    from service.cli.pools import format_pools
    from service.cli.report import format_response, response_to_json

    if args.method == "get_app_stats" and not getattr(args, "app", None):
        print("fanout call get_app_stats: --app is required", file=sys.stderr)
        return 2
    settings = settings_of(args)
    command = "fanout pools" if args.method == "pool_stats" else "fanout call"
    try:
        result = _call_server(args, settings)
    except TTransportException as exc:
        print(
            f"{command}: cannot reach {settings.server.host}:{settings.server.port}: {exc.message}",
            file=sys.stderr,
        )
        return 1
    except _CallFailed as exc:
        if args.json:
            print(json.dumps(exc.to_json(), indent=2))
        else:
            print(f"{command}: {exc}", file=sys.stderr)
        return 1
    if args.method == "get_app_stats":
        print(
            json.dumps(response_to_json(result), indent=2) if args.json else format_response(result)
        )
        if args.start_ms is None and args.end_ms is None and not _holds_data(result):
            print(_EMPTY_DEFAULT_WINDOW, file=sys.stderr)
    elif args.method == "health":
        print(
            json.dumps(_health_to_json(result), indent=2) if args.json else _format_health(result)
        )
    elif args.method == "pool_stats":
        print(format_pools(result, args.json))
    elif args.method == "panel_info":
        print(
            json.dumps([vars(panel) for panel in result])
            if args.json
            else "\n".join(
                f"{p.name} ({p.source}): {'optional' if p.is_optional else 'essential'}"
                f"{', required' if p.is_required else ''}"
                for p in result
            )
        )
    else:
        print(json.dumps(result) if args.json else result)
    return 0


def sample_window() -> str:
    from service.samples.seed import SAMPLE_END_MS, SAMPLE_START_MS

    return f"--start-ms {SAMPLE_START_MS} --end-ms {SAMPLE_END_MS}"


_EMPTY_DEFAULT_WINDOW = (
    "fanout call: no panel holds data in the default window (the last hour); the embedded "
    "sample backends (fanout demo, fanout backends) hold the day 2026-01-01 UTC: "
    f"{sample_window()}"
)


def _holds_data(response: Any) -> bool:
    """Whether any panel of ``response`` holds something to show."""
    for panel in response.panels.values():
        if (
            (panel.error_summary and panel.error_summary.total)
            or (panel.top_list and panel.top_list.entries)
            or (panel.series and panel.series.points)
            or (panel.alert_list and panel.alert_list.alerts)
        ):
            return True
    return False


def _call_server(args: argparse.Namespace, settings: Settings) -> Any:
    """Make the call; raises _CallFailed for declared exceptions, TTransportException otherwise."""
    from service.client import OVERLOAD_RETRY_RATIO, AppStatsClient
    from service.idl import appstats

    if (args.tls_cert or args.tls_key) and not args.tls_ca:
        raise ConfigError("--tls-cert and --tls-key need --tls-ca (mutual TLS is TLS first)")
    with AppStatsClient(
        settings.server.host,
        settings.server.port,
        transport=settings.server.transport,
        protocol=settings.server.protocol,
        timeout_ms=args.deadline_ms,
        tls_ca_file=args.tls_ca,
        tls_server_hostname=args.tls_server_name,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        overload_retry_ratio=0.0 if args.no_retry else OVERLOAD_RETRY_RATIO,
        caller=args.caller,
    ) as client:
        if args.method != "get_app_stats":
            return getattr(client, args.method)()
        now_ms = int(SYSTEM_CLOCK.wall() * 1000)
        panels = [p.strip() for p in args.panels.split(",")] if args.panels else None
        try:
            return client.get_app_stats(
                args.app,
                args.start_ms if args.start_ms is not None else now_ms - 3_600_000,
                args.end_ms if args.end_ms is not None else now_ms,
                panels,
                deadline_ms=args.deadline_ms,
                criticality=args.criticality,
                fresh=args.fresh,
            )
        except (appstats.InvalidRequest, appstats.Overloaded, appstats.PanelFailed) as exc:
            raise _CallFailed(exc) from None


def _health_to_json(health: Any) -> dict[str, Any]:
    from service.idl import appstats

    return {
        "state": appstats.ServingState._VALUES_TO_NAMES[health.state],
        "backends": [
            {
                "name": b.name,
                "up": b.up,
                "latency_ms": b.latency_ms,
                "circuit": b.circuit or "",
                "detail": b.detail or "",
            }
            for b in health.backends
        ],
    }


def _format_health(health: Any) -> str:
    body = _health_to_json(health)
    lines = [
        f"state  {body['state']}",
        "",
        f"  {'backend':<10} {'up':<4} {'latency_ms':>10}  {'circuit':<9}  detail",
    ]
    for backend in body["backends"]:
        lines.append(
            f"  {backend['name']:<10} {'yes' if backend['up'] else 'no':<4} "
            f"{backend['latency_ms']:>10.1f}  {backend['circuit']:<9}  "
            f"{backend['detail']}".rstrip()
        )
    return "\n".join(lines)
