"""The ``fanout`` command: serve, call, pools, backends, demo, trace-ui."""

# gevent must patch the standard library before pymongo, requests or grpc load.
from service.patching import patch_all

patch_all()

import argparse
import logging
import os
import signal
import sys
import tomllib
from collections.abc import Sequence
from typing import Any

import gevent
from gevent.event import Event

from service.settings.config import ENV_PREFIX, ConfigError, Settings, load_settings
from service.wire.formats import PROTOCOLS, TRANSPORTS

__all__ = ["main"]

log = logging.getLogger("fanout")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.run(args) or 0)
    except ConfigError as exc:
        _say_config_error(str(exc), getattr(args, "config", None))
        return 2


def _say_config_error(message: str, config: str | None) -> None:
    """``configuration error: MESSAGE`` on stderr: one JSON line of the log when the log was
    asked for as JSON (``FANOUT_LOGGING_FORMAT``, else the file's ``[logging] format``),
    so that a log platform reading it gets JSON only; else a plain line."""
    if _json_log_asked(config):
        from service.operations.logs import LoggingSettings, configure_logging

        configure_logging(LoggingSettings(format="json"), "error")
        log.error("configuration error: %s", message)
    else:
        print(f"fanout: configuration error: {message}", file=sys.stderr)


def _json_log_asked(config: str | None) -> bool:
    """Whether the settings that failed to load ask for a JSON log: the variable, which
    overrides the file, else the file's ``[logging] format`` if the file reads as TOML."""
    asked = os.environ.get(f"{ENV_PREFIX}LOGGING_FORMAT")
    if asked is not None:
        return asked.strip().lower() == "json"
    try:
        with open(config or "", "rb") as file:
            section = tomllib.load(file).get("logging")
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return isinstance(section, dict) and section.get("format") == "json"


_DESCRIPTION = (
    "Fanout gathers a dashboard's panels in parallel (MongoDB aggregations, HTTP "
    "services) and serves them over Thrift RPC. Settings come from a TOML file "
    "(--config), FANOUT_<SECTION>_<KEY> variables and these flags, in rising order."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fanout")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


_LOG_LEVELS = ["debug", "info", "warning", "error"]


def _common_flags() -> argparse.ArgumentParser:
    """Flags every command takes after its name too (``fanout serve --log-level info``).

    SUPPRESS: a command's parser sets nothing it was not given, so the same flag
    before the command's name is not overwritten by a default.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=_LOG_LEVELS,
        help="the lowest level logged to stderr (default: warning)",
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fanout",
        description=_DESCRIPTION,
        epilog="'fanout <command> --help' describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"fanout {_version()}")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=_LOG_LEVELS,
        help="the lowest level logged to stderr (default: warning)",
    )
    commands = _Commands(parser.add_subparsers(dest="command", required=True), _common_flags())

    serve = commands.add_parser("serve", help="run the Thrift server")
    _server_flags(serve, with_config=True)
    serve.add_argument(
        "--workers",
        metavar="N|auto",
        help="pre-forked worker processes sharing the port; auto: one per core (default 1)",
    )
    serve.set_defaults(run=_serve)

    call = commands.add_parser("call", help="call a running server, as the web tier would")
    call.add_argument(
        "method",
        choices=["ping", "health", "panels", "panel_info", "pool_stats", "get_app_stats"],
        help="the RPC method to call",
    )
    _server_flags(call, with_config=False)
    call.add_argument("--app", help="application name (get_app_stats)")
    call.add_argument("--start-ms", type=int, help="window start, epoch ms (default: an hour ago)")
    call.add_argument("--end-ms", type=int, help="window end, epoch ms, exclusive (default: now)")
    call.add_argument("--panels", help="comma-separated panel names (default: all)")
    call.add_argument(
        "--criticality",
        choices=["CRITICAL_PLUS", "CRITICAL", "SHEDDABLE_PLUS", "SHEDDABLE"],
        help="what the server may shed first under overload (default: CRITICAL); a refused "
        "call is tried again, as the web tier's client does, unless --no-retry",
    )
    call.add_argument(
        "--no-retry",
        action="store_true",
        help="print the first answer as it is: an Overloaded is shown, not tried again after "
        "its retry_after_ms (what a caller of that criticality gets first)",
    )
    call.add_argument(
        "--fresh",
        action="store_true",
        help="an answer that reads no cached bucket (the results cache)",
    )
    call.add_argument(
        "--caller",
        help="who calls (RequestMeta.caller), for the server's fair share under overload "
        "(default: the anonymous caller, or the --tls-cert's name)",
    )
    call.add_argument(
        "--json",
        action="store_true",
        help="print the response, or the declared error it got, as JSON",
    )
    _client_flags(call)
    call.set_defaults(run=_call)

    pools = commands.add_parser(
        "pools", help="ask a running server how full its pools are and what size they should be"
    )
    _server_flags(pools, with_config=False)
    pools.add_argument("--json", action="store_true", help="print the report as JSON")
    _client_flags(pools)
    pools.set_defaults(run=_call, method="pool_stats", no_retry=False, caller=None)

    backends = commands.add_parser("backends", help="run the embedded sample backends")
    for name in ("mongo", "alerts", "metrics"):
        backends.add_argument(
            f"--{name}-port",
            type=_port,
            default=0,
            metavar="PORT",
            help=f"the {name} backend's port (default: 0, a free port)",
        )
    backends.set_defaults(run=_backends)

    demo = commands.add_parser("demo", help="start backends and server, call once, print, stop")
    demo.add_argument("--config", metavar="FILE", help="TOML settings file")
    demo.add_argument("--app", default="shop", help="sample application to show")
    demo.set_defaults(run=_demo)

    trace_ui = commands.add_parser(
        "trace-ui", help="show the demo's traces in a local Zipkin UI (needs Java 17)"
    )
    trace_ui.add_argument(
        "--screenshots",
        metavar="DIR",
        help="save PNGs of the traces and the dependency graph (needs Chromium)",
    )
    trace_ui.add_argument(
        "--zipkin",
        metavar="URL",
        default="",
        help="use the Zipkin already running at URL instead of starting one",
    )
    trace_ui.add_argument(
        "--exit", action="store_true", help="stop Zipkin at once instead of waiting for Ctrl-C"
    )
    trace_ui.set_defaults(run=_trace_ui)
    return parser


class _Commands:
    """``add_subparsers()`` whose every command also takes the common flags."""

    def __init__(self, commands: Any, common: argparse.ArgumentParser) -> None:
        self._commands = commands
        self._common = common

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._commands.add_parser(
            name, parents=[self._common], **kwargs
        )
        return parser


def _trace_ui(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.cli.trace_ui import run_trace_ui

    screenshots = Path(args.screenshots) if args.screenshots else None
    return run_trace_ui(
        sys.stdout, zipkin_url=args.zipkin, screenshots=screenshots, keep=not args.exit
    )


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {port}")
    return port


def _server_flags(parser: argparse.ArgumentParser, with_config: bool) -> None:
    if with_config:
        parser.add_argument("--config", metavar="FILE", help="TOML settings file")
    parser.add_argument("--host", help="server host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="server port (default 9090)")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="Thrift transport; must match the server's (default framed)",
    )
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        help="Thrift protocol; must match the server's (default binary)",
    )


def _client_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that calls a running server: its budget and TLS."""
    parser.add_argument(
        "--deadline-ms",
        type=int,
        default=2000,
        help="the call's budget in milliseconds (default 2000)",
    )
    parser.add_argument(
        "--tls-ca", metavar="FILE", help="speak TLS, trusting the CAs in FILE (PEM)"
    )
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must hold (default: --host)",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="mutual TLS: present this client certificate (PEM; with --tls-ca)",
    )
    parser.add_argument(
        "--tls-key", metavar="FILE", help="the key of --tls-cert, if not in the same file"
    )


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(
        getattr(args, "config", None),
        overrides={
            "server.host": args.host,
            "server.port": args.port,
            "server.transport": args.transport,
            "server.protocol": args.protocol,
            "server.workers": getattr(args, "workers", None),
        },
    )


def _serve(args: argparse.Namespace) -> int:
    from service.operations.logs import configure_logging
    from service.workers.lifecycle import run_server

    settings = _settings(args)
    configure_logging(settings.logging, args.log_level)
    try:
        if settings.server.workers > 1:
            from service.workers.master import run_workers

            return run_workers(
                settings, on_ready=_print_serving_workers, reload=lambda: _settings(args)
            )
        return run_server(settings, on_ready=_print_serving, tune_gc=True)
    except OSError as exc:  # a port that cannot be bound (the text names it): exit, no restarts
        print(f"fanout: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _print_serving(address: tuple[str, int]) -> None:
    from service.operations.logs import console_line

    print(console_line(f"serving on {address[0]}:{address[1]}"), flush=True)


def _print_serving_workers(address: tuple[str, int], workers: int) -> None:
    from service.operations.logs import console_line

    # The master's pid: what `kill -HUP` (reload) and `kill -TTIN` (a worker more) take.
    line = f"serving on {address[0]}:{address[1]} ({workers} workers, master pid {os.getpid()})"
    print(console_line(line), flush=True)


def _wait_for_signal() -> None:
    stop = Event()
    handlers = [gevent.signal_handler(sig, stop.set) for sig in (signal.SIGTERM, signal.SIGINT)]
    try:
        stop.wait()
    finally:
        for handler in handlers:
            handler.cancel()


def _call(args: argparse.Namespace) -> int:
    from service.cli.call import run_call

    return run_call(args, _settings)


def _backends(args: argparse.Namespace) -> int:
    from service.cli.call import sample_window
    from service.samples import DemoBackends

    with DemoBackends(
        mongo_port=args.mongo_port, alerts_port=args.alerts_port, metrics_port=args.metrics_port
    ) as backends:
        print("Sample backends are running (seeded, deterministic):")
        for key, value in backends.settings_overrides().items():
            print(f"  {key:<24} {value}")
        print("\nPoint a server at them with this config (fanout serve --config FILE):\n")
        print(backends.config_snippet())
        print(
            f"Their data is the day 2026-01-01 UTC: fanout call get_app_stats --app shop "
            f"{sample_window()}\n",
            flush=True,
        )
        print("Press Ctrl-C to stop.", flush=True)
        _wait_for_signal()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from service.cli.demo import run_demo

    return run_demo(sys.stdout, app=args.app, config_path=args.config)


if __name__ == "__main__":
    sys.exit(main())
